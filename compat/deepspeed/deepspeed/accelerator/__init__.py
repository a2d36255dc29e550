"""``deepspeed.accelerator``: shardwise's accelerator object, plus DeepSpeed's support check."""
from shardwise.accelerator import Accelerator, get_accelerator, set_accelerator

# The device names DeepSpeed ships an accelerator class for.
SUPPORTED_ACCELERATOR_LIST = ["cuda", "cpu", "xpu", "npu", "mps", "hpu", "mlu", "sdaa", "supa"]


def is_current_accelerator_supported() -> bool:
    """Whether this process's accelerator is one DeepSpeed knows (shardwise answers for any torch device)."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST


__all__ = ["Accelerator", "SUPPORTED_ACCELERATOR_LIST", "get_accelerator", "is_current_accelerator_supported",
           "set_accelerator"]
