"""``deepspeed.runtime.data_pipeline.data_routing.scheduler``: ``RandomLTDScheduler`` is
shardwise.data.random_ltd.TokenDropSchedule."""
from shardwise.data.random_ltd import TokenDropSchedule as RandomLTDScheduler

__all__ = ["RandomLTDScheduler"]
