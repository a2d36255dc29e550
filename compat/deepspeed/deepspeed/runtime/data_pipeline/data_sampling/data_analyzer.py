"""``deepspeed.runtime.data_pipeline.data_sampling.data_analyzer``: ``DataAnalyzer`` is
shardwise.data.analyzer.DatasetAnalyzer (the same arguments, map/reduce and output files)."""
from shardwise.data.analyzer import DatasetAnalyzer as DataAnalyzer

__all__ = ["DataAnalyzer"]
