"""``deepspeed.utils.groups``: the sequence-parallel accessors DeepSpeed's ALST examples call.

They answer from the groups ``UlyssesSPAttentionHF.register_with_transformers`` created
(``shardwise.runtime.sequence_parallel.parallel_state_sp``); without them sequence parallelism is
off: size 1, rank 0, and the sequence-data-parallel group is every rank.
"""

from __future__ import annotations

from shardwise import comm


def _sp():
    from shardwise.runtime.sequence_parallel import parallel_state_sp

    return parallel_state_sp if parallel_state_sp.is_initialized() else None


def _get_sequence_parallel_group():
    sp = _sp()
    if sp is None:
        raise KeyError("No sequence parallel group found: call UlyssesSPAttentionHF.register_with_transformers first")
    return sp.get_sequence_parallel_group()


def _get_sequence_parallel_world_size() -> int:
    sp = _sp()
    return 1 if sp is None else sp.get_sequence_parallel_world_size()


def _get_sequence_parallel_rank() -> int:
    sp = _sp()
    return 0 if sp is None else sp.get_sequence_parallel_rank()


def _get_sequence_data_parallel_group():
    sp = _sp()
    return comm.get_world_group() if sp is None else sp.get_sequence_data_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    sp = _sp()
    return comm.get_world_size() if sp is None else sp.get_sequence_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    sp = _sp()
    return comm.get_rank() if sp is None else sp.get_sequence_data_parallel_rank()
