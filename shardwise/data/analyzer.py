"""Offline data analysis for curriculum learning: per-sample metrics, indexed by value (map/reduce).

``DatasetAnalyzer`` runs metric functions over a dataset (map) and merges the results (reduce) into
the files DeepSpeed's curriculum data sampler reads, with DeepSpeed's names, dtypes and layout (all
memory-mapped indexed datasets, ``shardwise.data.indexed_dataset``), under ``save_path/<metric>/``:

``single_value_per_sample`` metrics (one integer per sample, e.g. sequence length):

* ``<metric>_sample_to_metric``: item ``i`` is ``[value of sample i]``, in the narrowest integer dtype
  that holds the values;
* ``<metric>_index_to_metric``: item ``j`` is ``[j-th distinct value]``, ascending (same dtype);
* ``<metric>_index_to_sample``: item ``j`` lists the samples whose value is the ``j``-th distinct one,
  in dataset order (the narrowest unsigned dtype that holds ``len(dataset) - 1``);
* ``<metric>_index_to_sample_percentile_merged``: the same lists, concatenated in runs of
  ``max(1, distinct values // 100)`` values (for percentile-based difficulty).

``accumulate_value_over_samples`` metrics (e.g. token counts summed over the dataset):
``<metric>_metric_value``: one item, the sum.

The map phase splits the dataset over ``num_workers`` workers (e.g. one per node) and each worker's part
over ``num_threads`` parts, each written under ``<metric>/worker<w>_thread<t>/`` (a part's
``<metric>_sample_to_metric`` and ``<metric>_metric_to_sample_<value>.csv`` lists of sample ids); the
reduce phase (worker 0) merges them. Parts run one after another in this process.
"""

from __future__ import annotations

import csv
import glob
import logging
import os
from collections import defaultdict

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, Subset

from shardwise.data.indexed_dataset import VALID_DTYPES, IndexedDataset, IndexedDatasetWriter, smallest_int_dtype

__all__ = ["DatasetAnalyzer", "split_index", "split_dataset", "open_writer", "close_writer", "METRIC_TYPES"]

logger = logging.getLogger("shardwise")

METRIC_TYPES = ("single_value_per_sample", "accumulate_value_over_samples")


def split_index(start: int, end: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into ``parts`` contiguous ranges (``numpy.linspace`` boundaries, DeepSpeed's split)."""
    bounds = np.linspace(start, end, dtype=int, num=parts + 1)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(parts)]


def split_dataset(dataset, num_workers: int, worker_id: int, num_threads: int):
    workers = split_index(0, len(dataset), num_workers)
    return workers, split_index(workers[worker_id][0], workers[worker_id][1], num_threads)


def open_writer(prefix: str, dtype) -> IndexedDatasetWriter:
    return IndexedDatasetWriter(f"{prefix}.bin", dtype=dtype)


def close_writer(writer: IndexedDatasetWriter, prefix: str) -> None:
    writer.end_document()
    writer.finalize(f"{prefix}.idx")


def _same_dtype(values, dtype) -> bool:
    if values.dtype == dtype:
        return True
    try:  # a torch tensor against a numpy dtype, or the other way round
        ref = torch.empty(0, dtype=dtype).numpy().dtype if isinstance(dtype, torch.dtype) else np.dtype(dtype)
        got = values.numpy().dtype if torch.is_tensor(values) else values.dtype
        return got == ref
    except (TypeError, RuntimeError):
        return False


class DatasetAnalyzer:
    """Map/reduce of per-sample metrics (DeepSpeed's ``DataAnalyzer`` arguments, same meaning)."""

    def __init__(self, dataset, num_workers=1, worker_id=0, num_threads=1, num_threads_reduce=1,
                 specific_threads=(), batch_size=1, metric_names=(), metric_functions=(), metric_types=(),
                 metric_dtypes=(), save_path="./", collate_fn=None, custom_map_init=None, custom_map_update=None,
                 custom_map_finalize=None, custom_reduce=None, sample_indices=None) -> None:
        lengths = {len(metric_names), len(metric_functions), len(metric_types), len(metric_dtypes)}
        if len(lengths) != 1:
            raise ValueError("DataAnalyzer: metric_names, metric_functions, metric_types and metric_dtypes must "
                             f"have one entry per metric (got {len(metric_names)}, {len(metric_functions)}, "
                             f"{len(metric_types)}, {len(metric_dtypes)})")
        for name, kind, dtype in zip(metric_names, metric_types, metric_dtypes):
            if kind not in METRIC_TYPES:
                raise ValueError(f"DataAnalyzer: metric {name!r} has type {kind!r}, not one of {METRIC_TYPES}")
            if dtype not in VALID_DTYPES:
                raise ValueError(f"DataAnalyzer: metric {name!r} has dtype {dtype}, not an indexed-dataset dtype")
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"DataAnalyzer: worker_id {worker_id} is not in [0, num_workers={num_workers})")
        self.dataset = dataset
        self.num_workers, self.worker_id = num_workers, worker_id
        self.num_threads, self.num_threads_reduce = num_threads, num_threads_reduce
        self.specific_threads = list(specific_threads)
        self.batch_size = batch_size
        self.metric_names, self.metric_functions = list(metric_names), list(metric_functions)
        self.metric_types, self.metric_dtypes = list(metric_types), list(metric_dtypes)
        self.save_path = save_path
        self.collate_fn = collate_fn
        self.custom_map_init, self.custom_map_update = custom_map_init, custom_map_update
        self.custom_map_finalize, self.custom_reduce = custom_map_finalize, custom_reduce
        self.sample_indices = sample_indices

    # -- map ---------------------------------------------------------------------------------------------
    def init_metric_results(self, thread_id, metric_names, metric_types, metric_dtypes, save_path, worker_id):
        results = []
        for name, kind, dtype in zip(metric_names, metric_types, metric_dtypes):
            part = f"{save_path}/{name}/worker{worker_id}_thread{thread_id}/"
            os.makedirs(part, exist_ok=True)
            if kind == "single_value_per_sample":
                s2m = f"{part}/{name}_sample_to_metric"
                m2s = f"{part}/{name}_metric_to_sample"
                for old in glob.glob(f"{glob.escape(m2s)}*"):
                    os.remove(old)  # the csv lists are appended to: start from none
                results.append({"sample_to_metric_fname": s2m, "sample_to_metric_builder": open_writer(s2m, dtype),
                                "metric_to_sample_fname": m2s, "metric_to_sample_dict": defaultdict(list)})
            else:
                results.append({"metric_value": None, "metric_value_fname": f"{part}/{name}_metric_value"})
        return results

    @staticmethod
    def _flush_lists(result, at_least: int) -> None:
        for value, samples in result["metric_to_sample_dict"].items():
            if len(samples) > at_least:
                with open(f"{result['metric_to_sample_fname']}_{value}.csv", "a", newline="") as f:
                    csv.writer(f).writerows([samples])
                result["metric_to_sample_dict"][value] = []

    def update_metric_results(self, data, metric_types, metric_dtypes, metric_functions, metric_results,
                              batch_start_idx=0):
        for kind, dtype, function, result in zip(metric_types, metric_dtypes, metric_functions, metric_results):
            values = function(data)
            if not (torch.is_tensor(values) or isinstance(values, np.ndarray)):
                raise TypeError(f"DataAnalyzer: a metric function returned {type(values).__name__}; it must "
                                "return a tensor or a numpy array")
            if not _same_dtype(values, dtype):
                raise TypeError(f"DataAnalyzer: a metric function returned dtype {values.dtype}, the metric's "
                                f"dtype is {dtype}")
            if isinstance(values, np.ndarray):
                values = torch.from_numpy(values)
            if kind == "single_value_per_sample":
                for row in range(values.shape[0]):
                    sample = batch_start_idx + row
                    if isinstance(data, dict) and "index" in data:  # Megatron datasets carry their ids
                        sample = int(data["index"][row][0].item())
                    elif self.sample_indices is not None:
                        sample = int(self.sample_indices[sample])
                    result["sample_to_metric_builder"].add_item(values[row].reshape(-1))
                    result["metric_to_sample_dict"][values[row].item()].append(sample)
                self._flush_lists(result, 100)
            elif result["metric_value"] is None:
                result["metric_value"] = values.clone()
            else:
                result["metric_value"].add_(values)

    def finalize_metric_results(self, metric_types, metric_dtypes, metric_results):
        for kind, dtype, result in zip(metric_types, metric_dtypes, metric_results):
            if kind == "single_value_per_sample":
                close_writer(result["sample_to_metric_builder"], result["sample_to_metric_fname"])
                self._flush_lists(result, 0)
            elif result["metric_value"] is not None:
                writer = open_writer(result["metric_value_fname"], dtype)
                writer.add_item(result["metric_value"].reshape(-1))
                close_writer(writer, result["metric_value_fname"])

    def run_map_helper(self, thread_id):
        start, end = self.thread_splits[thread_id]
        part = Subset(self.dataset, list(range(start, end)))
        loader = DataLoader(part, batch_sampler=BatchSampler(SequentialSampler(part), self.batch_size, False),
                            num_workers=0, collate_fn=self.collate_fn)
        init = self.custom_map_init or self.init_metric_results
        update = self.custom_map_update or self.update_metric_results
        finalize = self.custom_map_finalize or self.finalize_metric_results
        results = init(thread_id, self.metric_names, self.metric_types, self.metric_dtypes, self.save_path,
                       self.worker_id)
        done = 0
        for data in loader:
            update(data, self.metric_types, self.metric_dtypes, self.metric_functions, results, start + done)
            done += min(self.batch_size, len(part) - done)  # samples in this batch, whatever its structure
        finalize(self.metric_types, self.metric_dtypes, results)
        logger.info("data analyzer: worker %d part %d mapped samples %d to %d", self.worker_id, thread_id, start, end)

    def run_map(self):
        self.worker_splits, self.thread_splits = split_dataset(self.dataset, self.num_workers, self.worker_id,
                                                               self.num_threads)
        for thread_id in (self.specific_threads or range(self.num_threads)):
            self.run_map_helper(thread_id)

    # -- reduce ------------------------------------------------------------------------------------------
    def _parts(self):
        return [(w, t) for w in range(self.num_workers) for t in range(self.num_threads)]

    def _reduce_single_value(self, name, folder, total):
        sample_dtype = smallest_int_dtype(0, total - 1)
        values, count = set(), 0
        for w, t in self._parts():
            part = IndexedDataset(f"{folder}/worker{w}_thread{t}/{name}_sample_to_metric", skip_warmup=True)
            if len(part):
                values.update(int(v) for v in np.unique(np.concatenate(part[0:len(part)])))
            count += len(part)
        if count != total:
            raise RuntimeError(f"DataAnalyzer reduce: the map results of metric {name!r} under {folder} hold "
                               f"{count} samples, the dataset {total} (did every map worker finish?)")
        value_dtype = smallest_int_dtype(min(values), max(values))
        # sample -> metric: each reduce part re-encodes its share of the map parts, then one merge
        parts = self._parts()
        for r, (lo, hi) in enumerate(split_index(0, len(parts), self.num_threads_reduce)):
            chunk = f"{folder}/{name}_sample_to_metric_thread{r}"
            writer = open_writer(chunk, value_dtype)
            for w, t in parts[lo:hi]:
                part = IndexedDataset(f"{folder}/worker{w}_thread{t}/{name}_sample_to_metric", skip_warmup=True)
                for row in range(len(part)):
                    writer.add_item(part[row].astype(np.int64))
            close_writer(writer, chunk)
        self._merge_chunks(f"{folder}/{name}_sample_to_metric", value_dtype)
        # metric -> samples, ascending values
        ordered = sorted(values)
        for r, (lo, hi) in enumerate(split_index(0, len(ordered), self.num_threads_reduce)):
            samples_w = open_writer(f"{folder}/{name}_index_to_sample_thread{r}", sample_dtype)
            metric_w = open_writer(f"{folder}/{name}_index_to_metric_thread{r}", value_dtype)
            for value in ordered[lo:hi]:
                samples: list[int] = []
                for w, t in parts:
                    path = f"{folder}/worker{w}_thread{t}/{name}_metric_to_sample_{value}.csv"
                    if os.path.isfile(path):
                        with open(path, newline="") as f:
                            for row in csv.reader(f):
                                samples += [int(x) for x in row]
                samples_w.add_item(np.asarray(samples, dtype=np.int64))
                metric_w.add_item(np.asarray([value], dtype=np.int64))
            close_writer(samples_w, f"{folder}/{name}_index_to_sample_thread{r}")
            close_writer(metric_w, f"{folder}/{name}_index_to_metric_thread{r}")
        self._merge_chunks(f"{folder}/{name}_index_to_sample", sample_dtype)
        self._merge_chunks(f"{folder}/{name}_index_to_metric", value_dtype)
        self.output_index_to_sample_percentile(f"{folder}/{name}_index_to_sample", f"{folder}/{name}_index_to_metric",
                                               name, folder, total, sample_dtype)

    def _merge_chunks(self, prefix, dtype):
        writer = open_writer(prefix, dtype)
        for r in range(self.num_threads_reduce):
            writer.merge_file_(f"{prefix}_thread{r}")
        close_writer(writer, prefix)

    @staticmethod
    def output_index_to_sample_percentile(index_to_sample_fname, index_to_metric_fname, metric_name,
                                          metric_save_path, total_num_samples, sample_idx_dtype):
        """Write ``<metric>_index_to_sample_percentile_merged``; returns {value: number of samples}."""
        to_sample = IndexedDataset(index_to_sample_fname, skip_warmup=True)
        to_metric = IndexedDataset(index_to_metric_fname, skip_warmup=True)
        per_value = {}
        for j in range(len(to_sample)):
            per_value[to_metric[j][0]] = len(to_sample[j])
        if sum(per_value.values()) != total_num_samples:
            raise RuntimeError(f"{index_to_sample_fname}: lists {sum(per_value.values())} samples, expected "
                               f"{total_num_samples}")
        prefix = f"{metric_save_path}/{metric_name}_index_to_sample_percentile_merged"
        writer = open_writer(prefix, sample_idx_dtype)
        run = max(1, len(to_sample) // 100)
        for j in range(0, len(to_sample), run):
            writer.add_item(np.concatenate(to_sample[j:min(len(to_sample), j + run)]).astype(np.int64))
        close_writer(writer, prefix)
        return per_value

    def _reduce_accumulated(self, name, folder):
        total = None
        for w, t in self._parts():
            part = IndexedDataset(f"{folder}/worker{w}_thread{t}/{name}_metric_value", skip_warmup=True)
            value = np.array(part[0], dtype=np.int64)
            total = value if total is None else total + value
        prefix = f"{folder}/{name}_metric_value"
        writer = open_writer(prefix, smallest_int_dtype(int(total.min()), int(total.max())))
        writer.add_item(total)
        close_writer(writer, prefix)

    def merge_map_results(self, dataset, metric_names, metric_types, save_path, num_workers, num_threads,
                          num_threads_reduce):
        for name, kind in zip(metric_names, metric_types):
            folder = f"{save_path}/{name}/"
            if kind == "single_value_per_sample":
                self._reduce_single_value(name, folder, len(dataset))
            else:
                self._reduce_accumulated(name, folder)

    def run_reduce(self):
        reduce = self.custom_reduce or self.merge_map_results
        reduce(self.dataset, self.metric_names, self.metric_types, self.save_path, self.num_workers,
               self.num_threads, self.num_threads_reduce)

    def run_map_reduce(self, comm_group=None):
        """Map this worker's part; once every worker has (a barrier when a process group exists), worker 0
        reduces; the others wait for it."""
        from shardwise import comm

        self.run_map()
        if comm.is_initialized():
            comm.barrier(group=comm_group)
        if self.worker_id == 0:
            self.run_reduce()
        if comm.is_initialized():
            comm.barrier(group=comm_group)
