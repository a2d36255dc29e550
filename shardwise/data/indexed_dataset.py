"""Megatron's memory-mapped indexed dataset: a ``.bin`` of concatenated 1-D arrays and an ``.idx`` index.

The byte layout (what Megatron-LM, Megatron-DeepSpeed, gpt-neox and DeepSpeed's data sampler read):

``.idx``: ``b"MMIDIDX\\x00\\x00"``, version ``<Q`` = 1, dtype code ``<B`` (``DTYPE_CODES``), item
count ``<Q``, document count ``<Q``, then the item sizes (int32, elements), the item byte offsets
into ``.bin`` (int64) and the document index (int64: the first item of each document, plus the end).

``.bin``: the items' elements, back to back, in the dtype the code names.

    with IndexedDatasetWriter("out.bin", dtype=np.uint16) as w:   # or w.finalize("out.idx")
        w.add_item(torch.tensor([1, 2, 3])); w.end_document()
    ds = IndexedDataset("out")                                     # ds[0] -> array([1, 2, 3], uint16)
"""

from __future__ import annotations

import os
import shutil
import struct
from itertools import accumulate

import numpy as np
import torch

__all__ = ["DTYPE_CODES", "dtype_code", "IndexedDataset", "IndexedDatasetWriter", "smallest_int_dtype",
           "token_dtype", "index_file_path", "data_file_path"]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# the dtype codes of the format: numpy dtype and, where torch has it, the torch dtype
DTYPE_CODES: dict[int, tuple[type, torch.dtype | None]] = {
    1: (np.uint8, torch.uint8), 2: (np.int8, torch.int8), 3: (np.int16, torch.int16), 4: (np.int32, torch.int32),
    5: (np.int64, torch.int64), 6: (np.uint16, None), 7: (np.uint32, None), 8: (np.uint64, None),
}
VALID_DTYPES = {np_dt for np_dt, _ in DTYPE_CODES.values()} | {t for _, t in DTYPE_CODES.values() if t is not None}


def dtype_code(dtype) -> int:
    """The format's code for a numpy or torch integer dtype."""
    for code, (np_dt, torch_dt) in DTYPE_CODES.items():
        if dtype in (np_dt, torch_dt) or (not isinstance(dtype, torch.dtype) and np.dtype(dtype) == np.dtype(np_dt)):
            return code
    shown = dtype if isinstance(dtype, torch.dtype) else np.dtype(dtype).name
    raise ValueError(f"indexed dataset: dtype {shown} is not one of the format's dtypes "
                     f"({', '.join(np.dtype(d).name for d, _ in DTYPE_CODES.values())})")


def _numpy_dtype(dtype) -> type:
    return DTYPE_CODES[dtype_code(dtype)][0]


def token_dtype(vocab_size: int | None = None) -> type:
    """uint16 for vocabularies under 65500 tokens, int32 otherwise (Megatron's choice)."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def smallest_int_dtype(min_value: int, max_value: int) -> type:
    """The narrowest integer dtype holding ``[min_value, max_value]`` (unsigned when min >= 0)."""
    kinds = ((np.uint8, np.uint16, np.uint32, np.uint64) if min_value >= 0
             else (np.int8, np.int16, np.int32, np.int64))
    for kind in kinds:
        info = np.iinfo(kind)
        if info.min <= min_value and max_value <= info.max:
            return kind
    return kinds[-1]


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


class IndexedDataset(torch.utils.data.Dataset):
    """Read-only view of ``prefix.bin`` / ``prefix.idx``: ``ds[i]`` is item ``i`` (a numpy array backed by
    the memory map), ``ds[a:b]`` a list of them, ``ds.get(i, offset, length)`` part of one."""

    class Index:
        """The ``.idx`` file: ``sizes``, ``pointers`` (byte offsets), ``doc_idx``, ``dtype``."""

        _HDR_MAGIC = MAGIC

        def __init__(self, path: str, skip_warmup: bool = True) -> None:
            with open(path, "rb") as f:
                head = f.read(len(MAGIC))
                if head != MAGIC:
                    raise ValueError(f"{path}: not a memory-mapped indexed-dataset index (header {head!r}, "
                                     f"expected {MAGIC!r})")
                (version,) = struct.unpack("<Q", f.read(8))
                if version != VERSION:
                    raise ValueError(f"{path}: index version {version}, only version {VERSION} is known")
                (code,) = struct.unpack("<B", f.read(1))
                if code not in DTYPE_CODES:
                    raise ValueError(f"{path}: unknown dtype code {code}")
                self._dtype = DTYPE_CODES[code][0]
                self._dtype_size = np.dtype(self._dtype).itemsize
                self._len, self._doc_count = struct.unpack("<QQ", f.read(16))
                offset = f.tell()
            if not skip_warmup:
                _read_through(path)
            self._bin_buffer_mmap = np.memmap(path, mode="r", order="C")
            self._bin_buffer = memoryview(self._bin_buffer_mmap)
            self._sizes = np.frombuffer(self._bin_buffer, dtype=np.int32, count=self._len, offset=offset)
            offset += self._sizes.nbytes
            self._pointers = np.frombuffer(self._bin_buffer, dtype=np.int64, count=self._len, offset=offset)
            offset += self._pointers.nbytes
            self._doc_idx = np.frombuffer(self._bin_buffer, dtype=np.int64, count=self._doc_count, offset=offset)

        @classmethod
        def writer(cls, path: str, dtype):
            return _IndexWriter(path, dtype)

        @property
        def dtype(self):
            return self._dtype

        @property
        def sizes(self) -> np.ndarray:
            return self._sizes

        @property
        def pointers(self) -> np.ndarray:
            return self._pointers

        @property
        def doc_idx(self) -> np.ndarray:
            return self._doc_idx

        def __getitem__(self, i):
            return self._pointers[i], self._sizes[i]

        def __len__(self) -> int:
            return self._len

    def __init__(self, path: str, skip_warmup: bool = False) -> None:
        super().__init__()
        self._open(path, skip_warmup)

    def _open(self, path: str, skip_warmup: bool = True) -> None:
        self._path = path
        for f in (index_file_path(path), data_file_path(path)):
            if not os.path.exists(f):
                raise FileNotFoundError(f"indexed dataset {path!r}: {f} does not exist (give the path without "
                                        ".bin/.idx)")
        self._index = self.Index(index_file_path(path), skip_warmup)
        if not skip_warmup:
            _read_through(data_file_path(path))
        if os.path.getsize(data_file_path(path)) == 0:  # np.memmap refuses empty files
            self._bin_buffer_mmap = np.zeros(0, dtype=np.uint8)
        else:
            self._bin_buffer_mmap = np.memmap(data_file_path(path), mode="r", order="C")
        self._bin_buffer = memoryview(self._bin_buffer_mmap)

    def __getstate__(self):
        return self._path

    def __setstate__(self, state) -> None:
        self._open(state, skip_warmup=True)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            ptr, size = self._index[idx]
            return np.frombuffer(self._bin_buffer, dtype=self._index.dtype, count=int(size), offset=int(ptr))
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("indexed dataset: slices must be contiguous (step 1)")
            sizes = self._index.sizes[start:stop]
            if len(sizes) == 0:
                return []
            whole = np.frombuffer(self._bin_buffer, dtype=self._index.dtype, count=int(sizes.sum()),
                                  offset=int(self._index.pointers[start]))
            return np.split(whole, list(accumulate(sizes))[:-1])
        raise TypeError(f"indexed dataset: index with an int or a slice, not {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Elements ``offset : offset + length`` of item ``idx`` (to its end without ``length``)."""
        ptr, size = self._index[idx]
        if length is None:
            length = int(size) - offset
        ptr = int(ptr) + offset * np.dtype(self._index.dtype).itemsize
        return np.frombuffer(self._bin_buffer, dtype=self._index.dtype, count=length, offset=ptr)

    @property
    def sizes(self) -> np.ndarray:
        return self._index.sizes

    def size(self, index: int) -> int:
        return self._index.sizes[index]

    @property
    def doc_idx(self) -> np.ndarray:
        return self._index.doc_idx

    def get_doc_idx(self) -> np.ndarray:
        return self._index._doc_idx

    def set_doc_idx(self, doc_idx) -> None:
        self._index._doc_idx = doc_idx

    @property
    def supports_prefetch(self) -> bool:
        return False

    @property
    def dtype(self):
        return self._index.dtype

    @staticmethod
    def exists(path: str) -> bool:
        return os.path.exists(index_file_path(path)) and os.path.exists(data_file_path(path))


def _read_through(path: str) -> None:
    """Read a file once so its pages are in the page cache (Megatron's "warm-up")."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


class _IndexWriter:
    def __init__(self, path: str, dtype) -> None:
        self.path, self.dtype = path, _numpy_dtype(dtype)

    def __enter__(self):
        self._file = open(self.path, "wb")
        self._file.write(MAGIC)
        self._file.write(struct.pack("<Q", VERSION))
        self._file.write(struct.pack("<B", dtype_code(self.dtype)))
        return self

    def write(self, sizes, doc_idx) -> None:
        sizes = np.asarray(sizes, dtype=np.int64)
        self._file.write(struct.pack("<QQ", len(sizes), len(doc_idx)))
        self._file.write(sizes.astype(np.int32).tobytes(order="C"))
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1] * np.dtype(self.dtype).itemsize, out=pointers[1:])
        self._file.write(pointers.tobytes(order="C"))
        self._file.write(np.asarray(doc_idx, dtype=np.int64).tobytes(order="C"))

    def __exit__(self, *exc) -> None:
        self._file.close()


class IndexedDatasetWriter:
    """Appends items to ``out_file`` (the ``.bin``); ``finalize(index_file)`` writes the ``.idx``.
    Items are converted to ``dtype`` (numpy or torch integer dtype)."""

    def __init__(self, out_file: str, dtype=np.int64) -> None:
        self._dtype = _numpy_dtype(dtype)
        self._data_file = open(out_file, "wb")
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    @property
    def dtype(self):
        return self._dtype

    def _write(self, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array, dtype=self._dtype)
        self._data_file.write(array.tobytes(order="C"))
        self._sizes.append(array.size)

    def add_item(self, tensor) -> None:
        """Append one item (a tensor or array; flattened in C order)."""
        self._write(tensor.numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor))

    def add_item_numpy(self, np_array: np.ndarray) -> None:
        self._write(np_array)

    def add_items(self, arr_list) -> None:
        for arr in arr_list:
            self._write(np.asarray(arr))

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def merge_file_(self, another_file: str) -> None:
        """Append every item and document of the indexed dataset at prefix ``another_file``."""
        index = IndexedDataset.Index(index_file_path(another_file))
        if np.dtype(index.dtype) != np.dtype(self._dtype):
            raise ValueError(f"merge_file_: {another_file} holds {np.dtype(index.dtype).name}, this writer "
                             f"{np.dtype(self._dtype).name}")
        offset = len(self._sizes)
        self._sizes.extend(int(s) for s in index.sizes)
        self._doc_idx.extend(int(offset + d) for d in index.doc_idx[1:])
        with open(data_file_path(another_file), "rb") as f:
            shutil.copyfileobj(f, self._data_file)
        self._data_file.flush()

    def finalize(self, index_file: str) -> None:
        self._data_file.close()
        with IndexedDataset.Index.writer(index_file, self._dtype) as index:
            index.write(self._sizes, self._doc_idx)
