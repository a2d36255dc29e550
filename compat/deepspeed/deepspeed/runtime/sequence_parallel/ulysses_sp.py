"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: shardwise's Ulysses sequence parallelism
(``shardwise.runtime.sequence_parallel.ulysses_sp``) with DeepSpeed's return value:
``UlyssesSPAttentionHF.register_with_transformers`` returns the ``parallel_state_sp`` module (the mpu DeepSpeed
hands to ``deepspeed.initialize``), a view of the grid shardwise's returns."""

from __future__ import annotations

from shardwise.runtime.sequence_parallel import ulysses_sp as _ulysses
from shardwise.runtime.sequence_parallel.ulysses_sp import *  # noqa: F401,F403
from shardwise.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter  # noqa: F401


class UlyssesSPAttentionHF(_ulysses.UlyssesSPAttentionHF):
    __doc__ = _ulysses.UlyssesSPAttentionHF.__doc__

    @classmethod
    def register_with_transformers(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size,
                                   micro_batch_size, seq_length=None, seq_length_is_variable=True,
                                   disable_in_eval=False, max_length=None, **shardwise_options):
        """Install Ulysses attention (``shardwise``'s ``register_with_transformers``) and return DeepSpeed's
        ``parallel_state_sp`` module, or ``None`` when ``sequence_parallel_size`` is 1."""
        grid = super().register_with_transformers(
            model_name_or_path, core_attn_implementation, sequence_parallel_size, micro_batch_size,
            seq_length=seq_length, seq_length_is_variable=seq_length_is_variable, disable_in_eval=disable_in_eval,
            max_length=max_length, **shardwise_options)
        if grid is None:
            return None
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        return parallel_state_sp


def __getattr__(name: str):  # the tiled computations, imported lazily from their own file
    return getattr(_ulysses, name)
