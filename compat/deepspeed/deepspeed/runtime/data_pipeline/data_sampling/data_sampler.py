"""``deepspeed.runtime.data_pipeline.data_sampling.data_sampler``: ``DeepSpeedDataSampler`` is
shardwise.data.curriculum_sampler.CurriculumSampler (DeepSpeed's arguments, clusters, random draws and
batches)."""
from shardwise.data.curriculum_sampler import CurriculumSampler as DeepSpeedDataSampler

__all__ = ["DeepSpeedDataSampler"]
