"""``deepspeed.accelerator.supa_accelerator``: ``SUPA_Accelerator``, shardwise's accelerator object
(``shardwise.accelerator.Accelerator``)
for Biren SUPA through torch.accelerator (torch_supa installed; bccl),
as DeepSpeed's class of that name is for
``deepspeed.accelerator.set_accelerator(SUPA_Accelerator())``."""
from shardwise.accelerator import Accelerator

__all__ = ["SUPA_Accelerator"]


class SUPA_Accelerator(Accelerator):  # noqa: N801 (DeepSpeed's name)
    def __init__(self) -> None:
        super().__init__("supa")

    def communication_backend_name(self) -> str:
        return "bccl"
