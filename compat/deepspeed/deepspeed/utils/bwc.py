"""``deepspeed.utils.bwc``: read a tensor/pipeline degree, rank or group from an ``mpu`` object whichever
generation of the model-parallel-unit interface it speaks (Megatron's ``get_tensor_model_parallel_*``,
DeepSpeed's pipeline topology ``get_slice_parallel_*`` / ``get_pipe_parallel_*``, or the old
``get_model_parallel_*``), as DeepSpeed's helpers do. ``mpu=None`` means no model parallelism."""

__all__ = ["bwc_pipeline_parallel_group", "bwc_pipeline_parallel_world_size", "bwc_tensor_model_parallel_group",
           "bwc_tensor_model_parallel_rank", "bwc_tensor_model_parallel_world_size"]


def _tensor_query(mpu, what: str):
    for name in (f"get_tensor_model_parallel_{what}", f"get_slice_parallel_{what}"):
        if hasattr(mpu, name):
            return getattr(mpu, name)()
    return getattr(mpu, f"get_model_parallel_{what}")()


def bwc_tensor_model_parallel_rank(mpu=None) -> int:
    """This process's tensor-parallel rank (0 without an ``mpu``)."""
    return 0 if mpu is None else _tensor_query(mpu, "rank")


def bwc_tensor_model_parallel_world_size(mpu=None) -> int:
    """The tensor-parallel degree (1 without an ``mpu``)."""
    return 1 if mpu is None else _tensor_query(mpu, "world_size")


def bwc_tensor_model_parallel_group(mpu=None):
    """The tensor-parallel process group (None without an ``mpu``)."""
    return None if mpu is None else _tensor_query(mpu, "group")


def _pipe_query(mpu, what: str, default):
    if mpu is None:
        return default
    for name in (f"get_pipeline_model_parallel_{what}", f"get_pipe_parallel_{what}"):
        if hasattr(mpu, name):
            return getattr(mpu, name)()
    return default


def bwc_pipeline_parallel_world_size(mpu=None) -> int:
    """The pipeline degree (1 without an ``mpu`` or when it has no pipeline query)."""
    return _pipe_query(mpu, "world_size", 1)


def bwc_pipeline_parallel_group(mpu=None):
    """The pipeline process group (None without an ``mpu`` or when it has no pipeline query)."""
    return _pipe_query(mpu, "group", None)
