"""The engine side of an autotuning trial.

The autotuner writes each trial's config with ``autotuning.enabled`` and a ``metric_path``
(and, for the model-info run, ``model_info.profile`` with ``model_info_path``). Inside the
trial the engine then measures the steps from ``start_profile_step`` to ``end_profile_step``,
writes the metrics as JSON from rank 0 and ends the process, as DeepSpeed does.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from shardwise.profiling.params import count_parameters

logger = logging.getLogger("shardwise")


def _write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def write_model_info_and_exit(engine) -> None:
    """The model-info run: record the parameter count and stop before training."""
    info = engine.config.autotuning.model_info
    data = {
        "num_params": count_parameters(engine.module, trainable_only=False),
        "trainable_num_params": count_parameters(engine.module),
        "hidden_size": info.hidden_size if info else None,
        "num_layers": info.num_layers if info else None,
    }
    if engine.global_rank == 0:
        _write_json(engine.config.autotuning.model_info_path, data)
    logger.info("autotuning: wrote model info to %s; exiting", engine.config.autotuning.model_info_path)
    sys.exit(0)


class TrialRecorder:
    """Times the profiled window of a trial and writes ``{throughput, latency, flops}``."""

    def __init__(self, engine) -> None:
        at = engine.config.autotuning
        self.engine = engine
        self.start_step = int(at.start_profile_step)
        self.end_step = max(int(at.end_profile_step), self.start_step + 1)
        self.metric_path = at.metric_path
        self._t_start: float | None = None
        self.step_flops: float | None = None  # FLOPs of one optimizer step on this rank, from the profiler

    def after_step(self) -> None:
        step = self.engine.global_steps
        if step == self.start_step:
            self._t_start = time.perf_counter()
        elif step >= self.end_step and self._t_start is not None:
            self._finish(time.perf_counter() - self._t_start, step - self.start_step)

    def _finish(self, seconds: float, steps: int) -> None:
        latency = seconds / steps
        data = {
            "throughput": self.engine.train_batch_size() / latency,  # samples per second, all ranks
            "latency": latency * 1000.0,  # ms per optimizer step
            "flops": (self.step_flops / latency) if self.step_flops else None,  # FLOP/s per rank
            "profiled_steps": steps,
            "train_micro_batch_size_per_gpu": self.engine.train_micro_batch_size_per_gpu(),
            "gradient_accumulation_steps": self.engine.gradient_accumulation_steps(),
            "zero_stage": self.engine.config.zero_optimization.stage,
        }
        if self.engine.global_rank == 0:
            _write_json(self.metric_path, data)
        logger.info("autotuning: wrote metrics to %s; exiting", self.metric_path)
        sys.exit(0)
