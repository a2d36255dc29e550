"""``deepspeed.accelerator.mps_accelerator``: ``MPS_Accelerator``, shardwise's accelerator object
(``shardwise.accelerator.Accelerator``)
for Apple MPS through torch.accelerator (gloo), as DeepSpeed's class of that name is for
``deepspeed.accelerator.set_accelerator(MPS_Accelerator())``."""
from shardwise.accelerator import Accelerator

__all__ = ["MPS_Accelerator"]


class MPS_Accelerator(Accelerator):  # noqa: N801 (DeepSpeed's name)
    def __init__(self) -> None:
        super().__init__("mps")
