"""``deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset``: Megatron's memory-mapped indexed
dataset (shardwise.data.indexed_dataset: the same .bin/.idx bytes) under DeepSpeed's names."""
from __future__ import annotations


from shardwise.data.indexed_dataset import DTYPE_CODES as dtypes  # noqa: F401
from shardwise.data.indexed_dataset import VALID_DTYPES as valid_dtypes  # noqa: F401
from shardwise.data.indexed_dataset import IndexedDataset as MMapIndexedDataset
from shardwise.data.indexed_dataset import IndexedDatasetWriter as MMapIndexedDatasetBuilder
from shardwise.data.indexed_dataset import data_file_path, index_file_path  # noqa: F401
from shardwise.data.indexed_dataset import dtype_code as code  # noqa: F401
from shardwise.data.indexed_dataset import token_dtype

__all__ = ["MMapIndexedDataset", "MMapIndexedDatasetBuilder", "make_builder", "make_dataset", "dataset_exists",
           "infer_dataset_impl", "get_available_dataset_impl", "code", "dtypes", "valid_dtypes", "index_file_path",
           "data_file_path"]

_LEGACY = ("the legacy 'lazy'/'cached' indexed-dataset format (TNTIDX) is not supported by shardwise: "
           "use impl='mmap'")


def get_available_dataset_impl():
    return ["mmap"]


def infer_dataset_impl(path):
    """'mmap' when ``path``.idx is a memory-mapped index, else None."""
    if not MMapIndexedDataset.exists(path):
        return None
    with open(index_file_path(path), "rb") as f:
        return "mmap" if f.read(9) == MMapIndexedDataset.Index._HDR_MAGIC else None


def make_builder(out_file, impl, vocab_size=None):
    if impl != "mmap":
        raise ValueError(f"make_builder(impl={impl!r}): {_LEGACY}")
    return MMapIndexedDatasetBuilder(out_file, dtype=token_dtype(vocab_size))


def make_dataset(path, impl, skip_warmup=False):
    if impl == "infer":
        impl = infer_dataset_impl(path)
    if impl not in ("mmap", None):
        raise ValueError(f"make_dataset(impl={impl!r}): {_LEGACY}")
    if not MMapIndexedDataset.exists(path):
        print(f"Dataset does not exist: {path}")
        return None
    return MMapIndexedDataset(path, skip_warmup)


def dataset_exists(path, impl):
    return MMapIndexedDataset.exists(path)


