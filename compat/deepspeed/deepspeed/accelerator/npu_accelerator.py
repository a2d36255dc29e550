"""``deepspeed.accelerator.npu_accelerator``: ``NPU_Accelerator``, shardwise's accelerator object
(``shardwise.accelerator.Accelerator``)
for Ascend NPU through torch.accelerator (torch_npu installed; hccl),
as DeepSpeed's class of that name is for
``deepspeed.accelerator.set_accelerator(NPU_Accelerator())``."""
from shardwise.accelerator import Accelerator

__all__ = ["NPU_Accelerator"]


class NPU_Accelerator(Accelerator):  # noqa: N801 (DeepSpeed's name)
    def __init__(self) -> None:
        super().__init__("npu")
