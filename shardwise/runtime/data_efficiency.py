"""The engine's side of DeepSpeed's ``data_efficiency`` block (the accessors DeepSpeed's engine has).

With ``data_efficiency.data_routing.random_ltd.enabled``, the engine owns a random-LTD schedule
(``shardwise.data.random_ltd.TokenDropSchedule``, its ``global_batch_size`` and ``micro_batch_size``
taken from the batch settings); ``random_ltd_initialize()`` (called by DeepSpeed's
``convert_to_random_ltd`` once the model's layers are wrapped) hands it to the wrapped layers named by
``random_ltd_layer_id``; every training-mode forward first moves the schedule to the current global
step. The schedule's position follows the global step, so it is where it was after a checkpoint is
loaded (its count of consumed layer-tokens, which only DeepSpeed's unimplemented layer-token LR schedule
reads, starts again from 0).
"""

from __future__ import annotations

from typing import Any

from shardwise.data.efficiency import RANDOM_LTD_NEEDS, data_efficiency_settings
from shardwise.data.random_ltd import TokenDropSchedule, attach_schedule

__all__ = ["DataEfficiencyMixin"]


class DataEfficiencyMixin:
    """DeepSpeed's data-efficiency accessors and the random-LTD schedule, for ``Engine``."""

    def data_efficiency_config(self) -> dict[str, Any]:
        cached = self.__dict__.get("_data_efficiency")
        if cached is None:
            cached = self.__dict__["_data_efficiency"] = data_efficiency_settings(self.config.data_efficiency)
        return cached

    def data_efficiency_enabled(self) -> bool:
        return self.data_efficiency_config()["enabled"]

    def data_sampling_enabled(self) -> bool:
        return self.data_efficiency_config()["data_sampling"]["enabled"]

    def data_sampling_config(self) -> dict[str, Any]:
        return self.data_efficiency_config()["data_sampling"]

    def curriculum_learning_enabled(self) -> bool:
        return self.data_efficiency_config()["data_sampling"]["curriculum_learning"]["enabled"]

    def curriculum_learning_config(self) -> dict[str, Any]:
        return self.data_efficiency_config()["data_sampling"]["curriculum_learning"]

    def random_ltd_enabled(self) -> bool:
        return self.data_efficiency_config()["data_routing"]["random_ltd"]["enabled"]

    def random_ltd_config(self) -> dict[str, Any]:
        return self.data_efficiency_config()["data_routing"]["random_ltd"]

    @property
    def random_ltd_scheduler(self) -> TokenDropSchedule | None:
        """The random-LTD schedule (None unless random-LTD is enabled)."""
        if not self.random_ltd_enabled():
            return None
        schedule = self.__dict__.get("_random_ltd_scheduler")
        if schedule is None:
            config = self.random_ltd_config()
            missing = [k for k in RANDOM_LTD_NEEDS if k not in config]
            if missing:
                raise ValueError("data_efficiency.data_routing.random_ltd: missing " + ", ".join(missing))
            config["global_batch_size"] = self.train_batch_size()
            config["micro_batch_size"] = self.train_micro_batch_size_per_gpu()
            schedule = self.__dict__["_random_ltd_scheduler"] = TokenDropSchedule(config)
        return schedule

    def random_ltd_initialize(self) -> None:
        """Give the model's ``TokenDropLayer``s (DeepSpeed's ``RandomLayerTokenDrop``) the schedule."""
        if not self.random_ltd_enabled():
            raise ValueError("random_ltd_initialize: data_efficiency.data_routing.random_ltd is not enabled in the "
                             "config")
        attach_schedule(self.module, self.random_ltd_config(), self.random_ltd_scheduler)

    # -- curriculum data sampling ------------------------------------------------------------------
    def _curriculum_dataloader(self, dataset, batch_size, collate_fn, pin_memory):
        """``deepspeed_io``'s loader when ``data_sampling.curriculum_learning`` is enabled."""
        from shardwise import comm
        from shardwise.data.curriculum_sampler import CurriculumDataLoader, CurriculumSampler
        from shardwise.parallel_dims import ParallelDims, check_rule

        world = comm.get_world_size() if comm.is_initialized() else 1
        # (the ranks beside the data axis: pipe x tensor x sequence, counted as one model-parallel axis here)
        check_rule("curriculum_model_parallel",
                   ParallelDims(data=self.dp_world_size, tensor=world // self.dp_world_size, curriculum_sampling=True))
        sampler = CurriculumSampler(self.data_efficiency_config(), len(dataset), batch_size,
                                    self.grid.get_data_parallel_rank(), self.dp_world_size, self.dp_group,
                                    self.gradient_accumulation_steps(), self.global_rank,
                                    drop_last=self.config.dataloader_drop_last)
        return CurriculumDataLoader(dataset, sampler, batch_size, collate_fn=collate_fn, pin_memory=pin_memory,
                                    num_workers=self.data_sampling_config()["num_workers"],
                                    drop_last=self.config.dataloader_drop_last)

    def set_data_post_process_func(self, post_process_func) -> None:
        """Under curriculum sampling, call ``post_process_func(batch, sampler_state)`` on every training batch."""
        if getattr(self.training_dataloader, "post_process_func", "absent") != "absent":
            self.training_dataloader.post_process_func = post_process_func

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict) -> None:
        """``{metric: fn(step) -> difficulty}`` for the metrics with ``schedule_type: "custom"``."""
        if self.training_dataloader is not None and self.curriculum_learning_enabled():
            self.training_dataloader.data_sampler.set_custom_curriculum_learning_schedule(schedule_func_dict)

    def _data_efficiency_before_forward(self) -> None:
        if self.random_ltd_enabled() and self.module.training:
            self.random_ltd_scheduler.update_seq(self.global_steps)
