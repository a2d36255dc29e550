"""Curriculum data sampling: batches drawn from the samples whose difficulty the schedule allows so far
(DeepSpeed's ``DeepSpeedDataSampler``, the sampler of ``data_efficiency.data_sampling.curriculum_learning``).

For every metric in ``curriculum_metrics`` a ``CurriculumSchedule`` gives the difficulty at each global
batch. Whenever a difficulty changes, rank 0 forms a new *cluster*: the samples that became eligible
(``difficulty_type: "value"``: metric value in (previous, current] read from the analyzer's
``index_to_metric`` / ``index_to_sample`` files; ``"percentile"``: the next slice of samples in metric
order; with several clustered metrics, the intersection of what each allows, minus earlier clusters),
shuffles it and writes it under ``data_cluster_path`` as an indexed dataset. Each global batch draws
from the clusters in proportion to their sizes, each cluster read in its shuffled order and reshuffled
when used up; rank 0 broadcasts the global batch over the data-parallel group and each rank iterates its
slice of every micro-batch. The random draws use ``numpy.random.default_rng(data_efficiency.seed)`` in
DeepSpeed's order, so the batches are DeepSpeed's for the same files and seed.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from shardwise.data.curriculum import CurriculumSchedule
from shardwise.data.indexed_dataset import IndexedDataset, smallest_int_dtype

__all__ = ["CurriculumSampler", "CurriculumDataLoader"]

logger = logging.getLogger("shardwise")


class _Group:
    """The data-parallel group as the sampler needs it (size, rank 0's global rank, collectives)."""

    def __init__(self, group) -> None:
        from shardwise import comm

        self.comm, self.group = comm, group
        self.active = comm.is_initialized()

    def size(self) -> int:
        return self.comm.get_world_size(self.group) if self.active else 1

    def barrier(self) -> None:
        if self.active and self.size() > 1:
            self.comm.barrier(group=self.group)

    def broadcast(self, tensor: torch.Tensor) -> None:
        if self.active and self.size() > 1:
            self.comm.broadcast(tensor, self.comm.get_global_rank(self.group, 0), group=self.group)


class CurriculumSampler:
    """A batch sampler (``DataLoader(dataset, batch_sampler=...)``) yielding this rank's sample indices.

    ``data_efficiency_config`` is the ``data_efficiency`` block (its defaults are filled in as DeepSpeed's
    ``get_data_efficiency_config`` does); the other arguments are DeepSpeed's."""

    def __init__(self, data_efficiency_config, one_epoch_total_samples, micro_batch_size, data_parallel_rank,
                 data_parallel_size, data_parallel_group, gradient_accumulation_steps, global_rank,
                 drop_last=True) -> None:
        from shardwise.data.efficiency import data_efficiency_settings

        data_efficiency_config = data_efficiency_settings(data_efficiency_config)  # defaults filled in, as DeepSpeed's
        sampling = data_efficiency_config["data_sampling"]
        curriculum = sampling["curriculum_learning"]
        if one_epoch_total_samples <= 0 or micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(f"curriculum sampler: {one_epoch_total_samples} samples, micro batch {micro_batch_size}, "
                             f"data-parallel size {data_parallel_size}: all must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"curriculum sampler: data_parallel_rank {data_parallel_rank} is not below "
                             f"data_parallel_size {data_parallel_size}")
        self.data_efficiency_config = data_efficiency_config
        self.one_epoch_total_samples = one_epoch_total_samples
        self.index_dtype = smallest_int_dtype(0, one_epoch_total_samples)
        self.total_samples = one_epoch_total_samples * sampling["num_epochs"]
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.group = _Group(data_parallel_group)
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.global_batch_size = self.micro_batch_times_data_parallel_size * gradient_accumulation_steps
        self.global_rank = global_rank
        self.drop_last = drop_last
        self.np_rng = np.random.default_rng(data_efficiency_config["seed"])
        self.batch: list[int] = []
        self.consumed_samples = 0
        self.enabled = bool(curriculum.get("enabled"))
        self.curriculum_step = 0
        self.current_difficulties: dict = {}
        self.data_cluster_paths: list[str] = []
        self.data_cluster_current_position: list[int] = []
        self.curriculum_schedulers: dict[str, CurriculumSchedule] = {}
        self.curriculum_index_to_sample: dict[str, IndexedDataset] = {}
        self.curriculum_index_to_metric: dict[str, IndexedDataset] = {}
        self.difficulty_type: dict[str, str] = {}
        self.clustering_type: dict[str, str] = {}
        self.data_1epoch_size = None
        self.data_clusters: list[IndexedDataset] = []
        self.data_cluster_sizes: list[int] = []
        if not self.enabled:
            return
        self.cluster_root = curriculum.get("data_cluster_path")
        metrics = curriculum.get("curriculum_metrics")
        where = "data_efficiency.data_sampling.curriculum_learning"
        if not self.cluster_root or not isinstance(metrics, dict) or not metrics:
            raise ValueError(f"{where}: needs 'data_cluster_path' and a non-empty 'curriculum_metrics'")
        if global_rank == 0:
            os.makedirs(self.cluster_root, exist_ok=True)
        for metric, cfg in metrics.items():
            at = f"{where}.curriculum_metrics.{metric}"
            self.curriculum_schedulers[metric] = CurriculumSchedule(cfg, where=at)
            self.difficulty_type[metric] = cfg.get("difficulty_type")
            self.clustering_type[metric] = cfg.get("clustering_type")
            if self.difficulty_type[metric] not in ("value", "percentile"):
                raise ValueError(f"{at}.difficulty_type: {self.difficulty_type[metric]!r}; use 'value' or 'percentile'")
            if self.clustering_type[metric] not in ("single_cluster", "schedule_based"):
                raise ValueError(f"{at}.clustering_type: {self.clustering_type[metric]!r}; use 'single_cluster' or "
                                 "'schedule_based'")
            if global_rank == 0 and self.clustering_type[metric] != "single_cluster":
                self.curriculum_index_to_sample[metric] = IndexedDataset(cfg["index_to_sample_path"],
                                                                         skip_warmup=True)
                if self.difficulty_type[metric] == "value":
                    self.curriculum_index_to_metric[metric] = IndexedDataset(cfg["index_to_metric_path"],
                                                                             skip_warmup=True)

    def __len__(self) -> int:
        return self.total_samples

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict) -> None:
        for metric, schedule in self.curriculum_schedulers.items():
            if metric in schedule_func_dict:
                schedule.set_custom_get_difficulty(schedule_func_dict[metric])

    def get_start_end_idx(self, batch_len=None):
        """This rank's slice ``[start, end)`` of a micro-batch across the data-parallel ranks."""
        batch_len = batch_len or self.micro_batch_times_data_parallel_size
        size = self.group.size()
        return round(self.data_parallel_rank * batch_len / size), round((self.data_parallel_rank + 1) * batch_len / size)

    # -- which samples a difficulty allows ---------------------------------------------------------
    def get_sample_based_on_metric_value(self, metric, value_start, value_end):
        """The samples whose metric value is in ``(value_start, value_end]``, in value order."""
        to_sample, to_metric = self.curriculum_index_to_sample[metric], self.curriculum_index_to_metric[metric]
        rows = [np.copy(to_sample[r]) for r in range(len(to_sample)) if value_start < to_metric[r] <= value_end]
        return np.concatenate(rows, axis=None) if rows else None

    def get_sample_based_on_metric_percentile(self, metric, percentile_start, percentile_end):
        """The samples from the ``percentile_start``-th to the ``percentile_end``-th slice of the dataset in
        metric order (``max_difficulty`` slices; the last one takes the remainder)."""
        to_sample = self.curriculum_index_to_sample[metric]
        if self.data_1epoch_size is None:
            self.data_1epoch_size = sum(len(x) for x in to_sample)
        top = self.data_efficiency_config["data_sampling"]["curriculum_learning"]["curriculum_metrics"][metric][
            "max_difficulty"]
        per = self.data_1epoch_size // top
        start, end = per * percentile_start, per * percentile_end
        if percentile_end == top:
            end = self.data_1epoch_size
        pieces, seen = [], 0
        for r in range(len(to_sample)):
            size = len(to_sample[r])
            if seen + size > start:
                lo = max(0, start - seen)
                hi = size if seen + size <= end else end - seen
                pieces.append(np.copy(to_sample[r][lo:hi]))
            seen += size
            if seen >= end:
                break
        return np.concatenate(pieces, axis=None) if pieces else None

    # -- clusters ----------------------------------------------------------------------------------
    def _cluster_path(self, name: str) -> str:
        return f"{self.cluster_root}/{name}"

    def _write_cluster(self, path: str, samples: np.ndarray) -> None:
        from shardwise.data.analyzer import close_writer, open_writer

        writer = open_writer(path, self.index_dtype)
        writer.add_item_numpy(samples)
        close_writer(writer, path)

    def get_new_cluster(self, previous_difficulties) -> None:
        name = "cluster" + "".join(f"_{m}{self.current_difficulties[m]}" for m in self.curriculum_schedulers)
        path = self._cluster_path(name)
        if self.global_rank == 0:
            new = None
            clustered = [m for m, kind in self.clustering_type.items() if kind != "single_cluster"]
            if len(clustered) > 1:
                for metric in self.curriculum_schedulers:
                    if self.clustering_type[metric] == "single_cluster":
                        allowed = np.arange(0, self.one_epoch_total_samples, 1, dtype=self.index_dtype)
                    elif self.difficulty_type[metric] == "value":
                        allowed = self.get_sample_based_on_metric_value(metric, float("-inf"),
                                                                        self.current_difficulties[metric])
                    else:
                        allowed = self.get_sample_based_on_metric_percentile(metric, 0,
                                                                             self.current_difficulties[metric])
                    new = allowed if new is None else np.intersect1d(new, allowed, assume_unique=True)
                for cluster in self.data_clusters:
                    new = np.setdiff1d(new, cluster[0], assume_unique=True)
            else:
                if not self.data_clusters:
                    new = np.arange(0, self.one_epoch_total_samples, 1, dtype=self.index_dtype)
                for metric in clustered:
                    if self.difficulty_type[metric] == "value":
                        new = self.get_sample_based_on_metric_value(metric, previous_difficulties[metric],
                                                                    self.current_difficulties[metric])
                    else:
                        new = self.get_sample_based_on_metric_percentile(metric, previous_difficulties[metric],
                                                                         self.current_difficulties[metric])
            if new is not None and len(new) > 0:
                logger.info("curriculum: new data cluster of %d samples at difficulties %s", len(new),
                            self.current_difficulties)
                self.np_rng.shuffle(new)
                self._write_cluster(path, new)
                self.data_clusters.append(IndexedDataset(path, skip_warmup=True))
                self.data_cluster_sizes.append(len(self.data_clusters[-1][0]))
        self.group.barrier()
        if os.path.isfile(f"{path}.bin"):
            self.data_cluster_paths.append(name)
            self.data_cluster_current_position.append(0)

    def sample_from_clusters(self) -> np.ndarray:
        total = sum(self.data_cluster_sizes)
        weights = [size / total for size in self.data_cluster_sizes]
        picks = self.np_rng.choice(len(self.data_clusters), self.global_batch_size, replace=True, p=weights)
        return np.bincount(picks, minlength=len(self.data_clusters))

    def reshuffle_clusters(self, cidx: int) -> None:
        path = self._cluster_path(self.data_cluster_paths[cidx])
        cluster = np.copy(self.data_clusters[cidx][0])
        self.np_rng.shuffle(cluster)
        self._write_cluster(path, cluster)
        self.data_clusters[cidx] = IndexedDataset(path, skip_warmup=True)

    def get_sample_from_cluster(self, cidx: int, num_samples: int) -> list:
        start = self.data_cluster_current_position[cidx]
        samples = list(np.copy(self.data_clusters[cidx][0][start:start + num_samples]))
        self.data_cluster_current_position[cidx] += num_samples
        if len(samples) < num_samples:
            rest = num_samples - len(samples)
            self.reshuffle_clusters(cidx)
            samples += list(np.copy(self.data_clusters[cidx][0][:rest]))
            self.data_cluster_current_position[cidx] = rest
        return samples

    def get_next_global_batch(self) -> None:
        if not self.enabled:
            return
        self.curriculum_step += 1
        changed, previous = False, {}
        for metric, schedule in self.curriculum_schedulers.items():
            difficulty = schedule.update_difficulty(self.curriculum_step)
            if metric not in self.current_difficulties or difficulty != self.current_difficulties[metric]:
                changed = True
            if metric in self.current_difficulties:
                previous[metric] = self.current_difficulties[metric]
            else:
                previous[metric] = float("-inf") if self.difficulty_type[metric] == "value" else 0
            self.current_difficulties[metric] = difficulty
        if changed:
            self.get_new_cluster(previous)
        if self.global_rank == 0:
            batch = []
            for cidx, count in enumerate(self.sample_from_clusters()):
                batch += self.get_sample_from_cluster(cidx, count)
            self.np_rng.shuffle(batch)
            batch += [-1] * (self.global_batch_size - len(batch))  # same shape on every rank
            indices = torch.tensor([int(i) for i in batch], dtype=torch.long)
        else:
            indices = torch.empty(self.global_batch_size, dtype=torch.long)
        self.group.broadcast(indices)
        self.batch = indices[indices != -1].tolist()

    def __iter__(self):
        if not self.enabled:  # (DeepSpeed's sampler would loop forever drawing nothing)
            raise ValueError("curriculum sampler: data_efficiency.data_sampling.curriculum_learning is not enabled")
        step = self.micro_batch_times_data_parallel_size
        while self.consumed_samples <= self.total_samples:
            if not self.batch:
                self.get_next_global_batch()
            current, self.batch = self.batch[:step], self.batch[step:]
            if len(current) == step or (current and not self.drop_last):
                start, end = self.get_start_end_idx(len(current))
                yield current[start:end]
                self.consumed_samples += len(current)

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"batch": self.batch, "consumed_samples": self.consumed_samples,
                "curriculum_step": self.curriculum_step, "current_difficulties": self.current_difficulties,
                "data_cluster_paths": self.data_cluster_paths,
                "data_cluster_current_position": self.data_cluster_current_position,
                "np_rng_state": np.random.get_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.batch = state_dict["batch"]
        self.consumed_samples = state_dict["consumed_samples"]
        self.curriculum_step = state_dict["curriculum_step"]
        self.current_difficulties = state_dict["current_difficulties"]
        self.data_cluster_paths = [p.split("/")[-1] for p in state_dict["data_cluster_paths"]]
        self.data_cluster_current_position = state_dict["data_cluster_current_position"]
        np.random.set_state(state_dict["np_rng_state"])
        if self.global_rank == 0:
            for name in self.data_cluster_paths:
                self.data_clusters.append(IndexedDataset(self._cluster_path(name), skip_warmup=True))
                self.data_cluster_sizes.append(len(self.data_clusters[-1][0]))


class CurriculumDataLoader:
    """The engine's training loader under curriculum sampling: ``DataLoader(dataset, batch_sampler=sampler)``,
    each batch passed through ``post_process_func(batch, sampler.state_dict())`` when one is set (DeepSpeed's
    ``engine.set_data_post_process_func``: e.g. truncate to ``state["current_difficulties"]["seqlen"]``)."""

    def __init__(self, dataset, sampler: CurriculumSampler, batch_size: int, collate_fn=None, pin_memory=False,
                 num_workers: int = 0, drop_last: bool = True) -> None:
        self.dataset, self.data_sampler, self.batch_size = dataset, sampler, batch_size
        self.collate_fn, self.pin_memory, self.num_local_io_workers = collate_fn, pin_memory, num_workers
        self.post_process_func = None
        self.len = len(sampler) // batch_size if drop_last else -(-len(sampler) // batch_size)
        self.data_iterator = None

    def __len__(self) -> int:
        return self.len

    def __iter__(self):
        kwargs = {"collate_fn": self.collate_fn} if self.collate_fn is not None else {}
        self.dataloader = torch.utils.data.DataLoader(self.dataset, batch_sampler=self.data_sampler,
                                                      pin_memory=self.pin_memory,
                                                      num_workers=self.num_local_io_workers, **kwargs)
        self.data_iterator = iter(self.dataloader)
        return self

    def __next__(self):
        if self.data_iterator is None:
            iter(self)
        data = next(self.data_iterator)
        if self.post_process_func is not None:
            data = self.post_process_func(data, self.data_sampler.state_dict())
        return data
