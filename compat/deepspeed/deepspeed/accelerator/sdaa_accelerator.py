"""``deepspeed.accelerator.sdaa_accelerator``: ``SDAA_Accelerator``, shardwise's accelerator object
(``shardwise.accelerator.Accelerator``)
for Tecorigin SDAA through torch.accelerator (torch_sdaa installed; tccl),
as DeepSpeed's class of that name is for
``deepspeed.accelerator.set_accelerator(SDAA_Accelerator())``."""
from shardwise.accelerator import Accelerator

__all__ = ["SDAA_Accelerator"]


class SDAA_Accelerator(Accelerator):  # noqa: N801 (DeepSpeed's name)
    def __init__(self) -> None:
        super().__init__("sdaa")

    def communication_backend_name(self) -> str:
        return "tccl"
