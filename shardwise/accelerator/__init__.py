"""``deepspeed.accelerator``: one object answering device questions, whatever the device.

``get_accelerator()`` returns the accelerator of this process: the one ``torch.accelerator``
reports (CUDA, XPU, MPS, ...) or, without one, the CPU. Scripts written for DeepSpeed call it
for the device name, the communication backend, seeding, memory counters and pinning.
"""

from shardwise.accelerator.real_accelerator import Accelerator, get_accelerator, set_accelerator

__all__ = ["Accelerator", "get_accelerator", "set_accelerator"]
