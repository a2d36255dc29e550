"""``deepspeed.accelerator.mlu_accelerator``: ``MLU_Accelerator``, shardwise's accelerator object
(``shardwise.accelerator.Accelerator``)
for Cambricon MLU through torch.accelerator (torch_mlu installed; cncl),
as DeepSpeed's class of that name is for
``deepspeed.accelerator.set_accelerator(MLU_Accelerator())``."""
from shardwise.accelerator import Accelerator

__all__ = ["MLU_Accelerator"]


class MLU_Accelerator(Accelerator):  # noqa: N801 (DeepSpeed's name)
    def __init__(self) -> None:
        super().__init__("mlu")

    def communication_backend_name(self) -> str:
        return "cncl"
