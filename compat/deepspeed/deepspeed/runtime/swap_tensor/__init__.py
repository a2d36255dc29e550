"""``deepspeed.runtime.swap_tensor``: only DeepSpeed's size constant. DeepSpeed swaps a tensor to NVMe
when it has at least ``MIN_SWAPPABLE_BYTES``; shardwise's NVMe offload (``shardwise.zero.nvme_io``) writes
every offloaded tensor whatever its size, and the constant is kept for code that sizes tensors by it."""

MIN_SWAPPABLE_BYTES = 1024**2  # DeepSpeed's value (MIN_AIO_BYTES)

__all__ = ["MIN_SWAPPABLE_BYTES"]
