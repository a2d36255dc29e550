"""``deepspeed.runtime.data_pipeline.data_sampling.utils``: the analyzer's small helpers."""
from shardwise.data.analyzer import close_writer as close_mmap_dataset_builder  # noqa: F401
from shardwise.data.analyzer import open_writer as create_mmap_dataset_builder  # noqa: F401
from shardwise.data.analyzer import split_dataset, split_index  # noqa: F401
from shardwise.data.indexed_dataset import smallest_int_dtype as find_fit_int_dtype  # noqa: F401

__all__ = ["find_fit_int_dtype", "split_index", "split_dataset", "create_mmap_dataset_builder",
           "close_mmap_dataset_builder"]
