"""DeepSpeed module paths and top-level names shardwise does not provide, with the reason.

``import shardwise.inference.v2`` (what ``import deepspeed.inference.v2`` becomes) raises a ``ModuleNotFoundError``
that names the path and says why, instead of Python's bare "No module named". The finder sits
last on ``sys.meta_path``, so a real module of that name, once one exists, is found first.
"""

from __future__ import annotations

import importlib.abc
import sys

NOT_SUPPORTED: dict[str, str] = {
    "inference.v2": "DeepSpeed-FastGen (inference v2, ragged batching kernels) is not implemented; "
                    "use shardwise.init_inference (AutoTP) or `shardwise serve`",
    "inference.quantization": "DeepSpeed-Inference quantisation is not implemented",
    "module_inject.replace_module": "kernel injection (replace_transformer_layer) is not implemented; AutoTP "
                                    "is shardwise.tensor_parallel.autotp",
    "module_inject.containers": "kernel injection policies are not implemented",
    "module_inject.policy": "kernel injection policies are not implemented",
    "module_inject.auto_tp_model_utils": "kernel injection is not implemented",
    "model_implementations": "DeepSpeed's fused inference model implementations are not implemented",
    "compression": "the compression library was removed from DeepSpeed too (only deepspeed.compression.helper's "
                   "recursive_getattr/recursive_setattr remain, in the compat package)",
    "sequence.fpdt_layer": "FPDT (fully pipelined distributed transformer) is not implemented; for Hugging Face "
                           "models see shardwise.runtime.sequence_parallel",
    "sequence.cross_entropy": "the vocab-parallel cross-entropy is not implemented",
    "sequence.linear_cross_entropy": "the vocab-parallel cross-entropy is not implemented",
    "sequence.vocab_parallel_ops": "the vocab-parallel cross-entropy is not implemented",
    "linear": "DeepSpeed's OptimizedLinear / LoRA-quantized linear is not implemented",
    "compile": "DeepCompile is not implemented; engine.compile() compiles each block with torch.compile "
               "(docs/compile.md)",
    "nvme": "the NVMe benchmark tools are not provided (ZeRO's NVMe offload is: zero_optimization.offload_*)",
    "io": "DeepNVMe's public I/O handles are not provided",
    "runtime.checkpoint_engine": "checkpoints are written by shardwise.checkpoint (safetensors + manifest)",
    "monitor.monitor": "MonitorMaster is internal: the engine builds the monitors from the config",
    "runtime.domino": "Domino tensor-parallel overlap is not implemented",
    "runtime.fp16": "DeepSpeed's fp16 optimizer wrappers are internal; use the config's fp16 block",
    "runtime.zero.stage3": "ZeRO-3's internals differ; use shardwise.runtime.zero (GatheredParameters, Init)",
    "runtime.zero.stage_1_and_2": "ZeRO-1/2's internals differ; the engine builds them from the config",
    "runtime.zero.tiling": "TiledLinear is not implemented",
    "ops.sparse_attention.bert_sparse_self_attention": "BertSparseSelfAttention is not provided; use "
                                                       "shardwise.ops.sparse_attention.SparseSelfAttention",
    "ops.sparse_attention.sparse_attention_utils": "SparseAttentionUtils (Hugging Face model surgery) is not provided",
    "ops.sparse_attention.matmul": "the Triton block-sparse kernels are not provided: SparseSelfAttention uses "
                                   "torch's flex_attention",
    "ops.sparse_attention.softmax": "the Triton block-sparse kernels are not provided: SparseSelfAttention uses "
                                    "torch's flex_attention",
    "ops.quantizer": "quantization kernels are not implemented",
    "ops.deepspeed4science": "DeepSpeed4Science kernels are not implemented",
    "ops.aio": "use zero_optimization.offload_* with device nvme; the raw aio handle is not public",
    "autotuning.autotuner": "use `shardwise autotune` (or `shardwise run --autotuning tune`)",
    "launcher.launch": "use `shardwise run`",
    "elasticity.elastic_agent": "use `shardwise run --elastic MIN:MAX` (torch's elastic agent)",
    "env_report": "use `shardwise doctor`",
}

NOT_SUPPORTED_ATTRS: dict[str, str] = {
    "replace_transformer_layer": NOT_SUPPORTED["module_inject.replace_module"],
    "revert_transformer_layer": NOT_SUPPORTED["module_inject.replace_module"],
    "DeepSpeedConfig": "DeepSpeedConfig is in the compat package (deepspeed.runtime.config); shardwise.config.load_config "
                       "reads the same JSON",
}


class UnsupportedPathError(ModuleNotFoundError):
    """A DeepSpeed module path shardwise does not provide."""


def _reason(fullname: str) -> str | None:
    rel = fullname.removeprefix("shardwise.")
    parts = rel.split(".")
    for i in range(len(parts), 0, -1):
        reason = NOT_SUPPORTED.get(".".join(parts[:i]))
        if reason is not None:
            return reason
    return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("shardwise."):
            return None
        reason = _reason(fullname)
        if reason is None:
            return None
        ds = "deepspeed." + fullname.removeprefix("shardwise.")
        raise UnsupportedPathError(f"{fullname} (DeepSpeed's {ds}) is not supported by shardwise: {reason}. "
                                   "See docs/deepspeed-compat.md", name=fullname)


def install_finder() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())


def unsupported_attribute(name: str) -> AttributeError:
    reason = NOT_SUPPORTED_ATTRS.get(name)
    if reason is None:
        return AttributeError(f"module 'shardwise' has no attribute {name!r}")
    return AttributeError(f"shardwise.{name} (DeepSpeed's deepspeed.{name}) is not supported by shardwise: "
                          f"{reason}. See docs/deepspeed-compat.md")
