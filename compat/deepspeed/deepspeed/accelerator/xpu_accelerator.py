"""``deepspeed.accelerator.xpu_accelerator``: ``XPU_Accelerator``, shardwise's accelerator object
(``shardwise.accelerator.Accelerator``)
for Intel XPU through torch.accelerator (xccl), as DeepSpeed's class of that name is for
``deepspeed.accelerator.set_accelerator(XPU_Accelerator())``."""
from shardwise.accelerator import Accelerator

__all__ = ["XPU_Accelerator"]


class XPU_Accelerator(Accelerator):  # noqa: N801 (DeepSpeed's name)
    def __init__(self) -> None:
        super().__init__("xpu")
