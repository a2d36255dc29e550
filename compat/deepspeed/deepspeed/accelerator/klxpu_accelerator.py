"""``deepspeed.accelerator.klxpu_accelerator``: ``KLXPU_Accelerator``, shardwise's accelerator object for
KUNLUNXIN XPU, which presents itself to torch as CUDA (torch_xmlir installed; nccl): the CUDA accelerator under
the name ``klxpu``, as DeepSpeed's class of that name is for
``deepspeed.accelerator.set_accelerator(KLXPU_Accelerator())``."""
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator as CudaAccelerator

__all__ = ["KLXPU_Accelerator"]


class KLXPU_Accelerator(CudaAccelerator):  # noqa: N801 (DeepSpeed's name)
    def __repr__(self) -> str:
        return "Accelerator('klxpu')"

    def use_host_timers(self) -> bool:
        # KUNLUNXIN's device-event timers read 0 unless XPU_EVENT_KL3_ENABLE=1 (DeepSpeed's rule)
        import os
        return os.environ.get("XPU_EVENT_KL3_ENABLE", "0") != "1"
