"""Pipeline parallelism (DeepSpeed's ``deepspeed.pipe``)."""

from shardwise.pipe.module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec
from shardwise.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec", "ProcessTopology",
           "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineEngine"]


def __getattr__(name: str):
    if name == "PipelineEngine":
        from shardwise.pipe.engine import PipelineEngine

        return PipelineEngine
    raise AttributeError(f"module 'shardwise.pipe' has no attribute {name!r}")
