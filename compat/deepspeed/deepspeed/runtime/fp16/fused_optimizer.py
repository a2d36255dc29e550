"""``deepspeed.runtime.fp16.fused_optimizer``: the name ``FP16_Optimizer`` only (see the package)."""
from deepspeed._name_only import name_only

FP16_Optimizer = name_only(__name__, "FP16_Optimizer", "fp16 loss scaling is the engine's precision step "
                           "({'fp16': {'enabled': true}}); engine.optimizer is the torch optimizer")

__all__ = ["FP16_Optimizer"]
