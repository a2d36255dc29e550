"""``deepspeed.accelerator.hpu_accelerator``: ``HPU_Accelerator``, shardwise's accelerator object
(``shardwise.accelerator.Accelerator``)
for Gaudi HPU through torch.accelerator (the Habana torch plugin
installed; hccl), as DeepSpeed's class of that name is for
``deepspeed.accelerator.set_accelerator(HPU_Accelerator())``."""
from shardwise.accelerator import Accelerator

__all__ = ["HPU_Accelerator"]


class HPU_Accelerator(Accelerator):  # noqa: N801 (DeepSpeed's name)
    def __init__(self) -> None:
        super().__init__("hpu")
