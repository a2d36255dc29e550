"""DeepSpeed's ``deepspeed.runtime.pipe`` path; the implementation is ``shardwise.pipe``."""

from shardwise.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from shardwise.topology import ProcessTopology

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "ProcessTopology"]
