"""``deepspeed.runtime.zero.stage3``: the name ``DeepSpeedZeroOptimizer_Stage3`` only. shardwise's ZeRO-3 shards
parameters per tensor (docs/zero.md) and keeps the torch optimizer as ``engine.optimizer``."""
from deepspeed._name_only import name_only

DeepSpeedZeroOptimizer_Stage3 = name_only(__name__, "DeepSpeedZeroOptimizer_Stage3",
                                          "ZeRO-3 is a strategy of the engine (zero_optimization.stage 3); "
                                          "engine.optimizer is the torch optimizer")

__all__ = ["DeepSpeedZeroOptimizer_Stage3"]
