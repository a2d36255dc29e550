"""Real answers for DeepSpeed names the compat package has no module file for: names of modules that are
shardwise's own (``deepspeed.comm`` is ``shardwise.comm``) and DeepSpeed's availability questions about features
shardwise lacks, which answer as DeepSpeed does where the feature cannot run (False) rather than raising,
since code asks them precisely to choose another path. ``_surface`` consults this table, keyed by the
module where DeepSpeed defines the name, before it makes a not-supported object."""
from __future__ import annotations


def _false(*args, **kwargs) -> bool:
    return False


def _true(*args, **kwargs) -> bool:
    return True


def _is_compiling() -> bool:
    import torch

    return bool(torch.compiler.is_compiling())


def inference_all_reduce(tensor, op=None, group=None, async_op=False, prof=False, log_name="all_reduce", debug=None):
    """DeepSpeed's all-reduce for inference (a fused kernel where one is built): ``deepspeed.comm.all_reduce``,
    in place, synchronous."""
    from shardwise import comm

    return comm.all_reduce(tensor, op=comm.ReduceOp.SUM if op is None else op, group=group)


ANSWERS: dict[tuple[str, str], object] = {
    ("deepspeed.comm.comm", "inference_all_reduce"): inference_all_reduce,
    ("deepspeed.compile.util", "is_deepcompile_supported"): _false,
    ("deepspeed.ops.triton_ops._triton", "is_triton_available"): _false,
    ("deepspeed.ops.triton_ops.autoep_fused_token_ops", "is_available"): _false,
    ("deepspeed.ops.triton_ops.fused_rms_norm", "is_available"): _false,
    ("deepspeed.ops.triton_ops.fused_rotary_pos_emb", "is_available"): _false,
    ("deepspeed.comm.mori", "is_enabled"): _false,
    ("deepspeed.runtime.compiler", "is_compile_supported"): _true,  # torch >= 2.1 has torch.compile
    ("deepspeed.runtime.compiler", "is_compiling"): _is_compiling,
}
