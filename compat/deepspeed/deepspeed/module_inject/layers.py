"""``deepspeed.module_inject.layers``: the AutoTP layers (shardwise.tensor_parallel.autotp_layers)."""

from shardwise.tensor_parallel.autotp_layers import (LinearAllreduce, LinearLayer,  # noqa: F401
                                                     TensorParallel_Layer)

__all__ = ["LinearAllreduce", "LinearLayer", "TensorParallel_Layer"]
