"""``deepspeed.runtime.fp16.unfused_optimizer``: the name ``FP16_UnfusedOptimizer`` only (see the package)."""
from deepspeed._name_only import name_only

FP16_UnfusedOptimizer = name_only(__name__, "FP16_UnfusedOptimizer", "fp16 loss scaling is the engine's precision "
                                  "step ({'fp16': {'enabled': true}}); engine.optimizer is the torch optimizer")

__all__ = ["FP16_UnfusedOptimizer"]
