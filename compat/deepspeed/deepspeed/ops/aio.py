"""``deepspeed.ops.aio``: the builder's name only (``AsyncIOBuilder``, whose ``is_compatible()`` is False:
shardwise compiles no async-I/O extension). NVMe offload is ``zero_optimization.offload_*`` with device
``nvme``; DeepSpeed's raw aio handle is not provided."""
from .op_builder import AsyncIOBuilder


def __getattr__(name: str):
    raise AttributeError(f"deepspeed.ops.aio.{name} is not provided by shardwise: use zero_optimization.offload_* "
                         "with device nvme; the raw aio handle is not public. See docs/deepspeed-compat.md")


__all__ = ["AsyncIOBuilder"]
