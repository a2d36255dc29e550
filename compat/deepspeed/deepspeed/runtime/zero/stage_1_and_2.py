"""``deepspeed.runtime.zero.stage_1_and_2``: the name ``DeepSpeedZeroOptimizer`` only. shardwise's engine keeps
the torch optimizer (``engine.optimizer``) and runs ZeRO-1/2 as a strategy beside it, so no optimizer is ever
an instance of this class."""
from deepspeed._name_only import name_only

DeepSpeedZeroOptimizer = name_only(__name__, "DeepSpeedZeroOptimizer",
                                   "ZeRO-1/2 is a strategy of the engine (zero_optimization.stage); engine.optimizer "
                                   "is the torch optimizer")

__all__ = ["DeepSpeedZeroOptimizer"]
