"""``deepspeed.accelerator.cpu_accelerator``: ``CPU_Accelerator``, shardwise's accelerator object
(``shardwise.accelerator.Accelerator``)
for the CPU (gloo), as DeepSpeed's class of that name is for
``deepspeed.accelerator.set_accelerator(CPU_Accelerator())``."""
from shardwise.accelerator import Accelerator

__all__ = ["CPU_Accelerator"]


class CPU_Accelerator(Accelerator):  # noqa: N801 (DeepSpeed's name)
    def __init__(self) -> None:
        super().__init__(None)
