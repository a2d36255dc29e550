"""``deepspeed.accelerator.cuda_accelerator``: ``CUDA_Accelerator``, shardwise's accelerator object
(``shardwise.accelerator.Accelerator``)
for CUDA through torch.accelerator (nccl), as DeepSpeed's class of that name is for
``deepspeed.accelerator.set_accelerator(CUDA_Accelerator())``."""
from shardwise.accelerator import Accelerator

__all__ = ["CUDA_Accelerator"]


class CUDA_Accelerator(Accelerator):  # noqa: N801 (DeepSpeed's name)
    def __init__(self) -> None:
        super().__init__("cuda")
