"""``deepspeed.ops.op_builder``: DeepSpeed's extension builders, by name. shardwise compiles nothing: the
optimizers of ``deepspeed.ops`` (``DeepSpeedCPUAdam``, ``FusedAdam``, ``DeepSpeedCPUAdagrad``, ``FusedLamb``,
``DeepSpeedCPULion``, ``FusedLion``) run on torch's kernels, so their builders report ``is_compatible()``
(the op can be used here) and every ``load()`` raises: there is no compiled module to hand back."""
from __future__ import annotations


class OpBuilder:
    NAME = ""
    # the deepspeed.ops class that does this op's work in shardwise, or None when nothing does
    provided_by: str | None = None

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    @staticmethod
    def is_rocm_pytorch() -> bool:
        """Whether torch is a ROCm build (``torch.version.hip``), as DeepSpeed's builders ask."""
        import torch

        return getattr(torch.version, "hip", None) is not None

    @staticmethod
    def is_sycl_enabled() -> bool:
        return False  # no SYCL compiler is ever used: nothing is compiled

    def is_compatible(self, verbose: bool = False) -> bool:
        return self.provided_by is not None

    def load(self, verbose: bool = True):
        where = f"use {self.provided_by}, which runs on torch's kernels" if self.provided_by else \
            "shardwise does not implement this op"
        raise NotImplementedError(f"op_builder {type(self).__name__}.load(): shardwise builds no C++/CUDA "
                                  f"extensions ({where}). See docs/deepspeed-compat.md")

    def builder(self):
        self.load()


def _builder(name: str, op: str, provided_by: str | None) -> type[OpBuilder]:
    return type(name, (OpBuilder,), {"NAME": op, "provided_by": provided_by, "__module__": __name__})


CPUAdamBuilder = _builder("CPUAdamBuilder", "cpu_adam", "deepspeed.ops.adam.DeepSpeedCPUAdam")
FusedAdamBuilder = _builder("FusedAdamBuilder", "fused_adam", "deepspeed.ops.adam.FusedAdam")
CPUAdagradBuilder = _builder("CPUAdagradBuilder", "cpu_adagrad", "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad")
CPULionBuilder = _builder("CPULionBuilder", "cpu_lion", "deepspeed.ops.lion.DeepSpeedCPULion")
FusedLionBuilder = _builder("FusedLionBuilder", "fused_lion", "deepspeed.ops.lion.FusedLion")
FusedLambBuilder = _builder("FusedLambBuilder", "fused_lamb", "deepspeed.ops.lamb.FusedLamb")
AsyncIOBuilder = _builder("AsyncIOBuilder", "async_io", None)
QuantizerBuilder = _builder("QuantizerBuilder", "quantizer", None)
TransformerBuilder = _builder("TransformerBuilder", "transformer", None)
# the rest of DeepSpeed's builders (NAME as in DeepSpeed's CUDA builders): nothing provides their ops here
CCLCommBuilder = _builder("CCLCommBuilder", "deepspeed_ccl_comm", None)
ShareMemCommBuilder = _builder("ShareMemCommBuilder", "deepspeed_shm_comm", None)
DeepCompileBuilder = _builder("DeepCompileBuilder", "dc", None)
EvoformerAttnBuilder = _builder("EvoformerAttnBuilder", "evoformer_attn", None)
FPQuantizerBuilder = _builder("FPQuantizerBuilder", "fp_quantizer", None)
FlashAttentionBuilder = _builder("FlashAttentionBuilder", "flash_attn", None)
GDSBuilder = _builder("GDSBuilder", "gds", None)
InferenceBuilder = _builder("InferenceBuilder", "transformer_inference", None)
InferenceCoreBuilder = _builder("InferenceCoreBuilder", "inference_core_ops", None)
InferenceCutlassBuilder = _builder("InferenceCutlassBuilder", "cutlass_ops", None)
NotImplementedBuilder = _builder("NotImplementedBuilder", "deepspeed_not_implemented", None)
PinMemoryBuilder = _builder("PinMemoryBuilder", "pin_memory", None)
RaggedOpsBuilder = _builder("RaggedOpsBuilder", "ragged_device_ops", None)
RaggedUtilsBuilder = _builder("RaggedUtilsBuilder", "ragged_ops", None)
RandomLTDBuilder = _builder("RandomLTDBuilder", "random_ltd", None)
SpatialInferenceBuilder = _builder("SpatialInferenceBuilder", "spatial_inference", None)
StochasticTransformerBuilder = _builder("StochasticTransformerBuilder", "stochastic_transformer", None)
UtilsBuilder = _builder("UtilsBuilder", "utils", None)

ALL_OPS = {b.NAME: b() for b in (CPUAdamBuilder, FusedAdamBuilder, CPUAdagradBuilder, CPULionBuilder,
                                 FusedLionBuilder, FusedLambBuilder, AsyncIOBuilder, QuantizerBuilder,
                                 TransformerBuilder)}
