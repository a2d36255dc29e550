"""``shardwise autotune``: find the ZeRO stage and micro-batch size that train fastest here.

1. Read the user's config and its ``autotuning`` block; learn the parameter count from
   ``model_info.num_params`` or from a model-info run (the script stops after initialize).
2. Candidate stages: those ``check_supported`` accepts (or the ones the config lists),
   minus those whose model states the memory estimator says cannot fit.
   Candidate micro-batch sizes: ``num_tuning_micro_batch_sizes`` values in the allowed range.
3. A tuner (gridsearch, random, model_based) picks trials; each trial is a real short run
   measured between ``start_profile_step`` and ``end_profile_step``.
4. Write every trial's record, a summary table and the best config
   (``results_dir/ds_config_optimal.json``), ready to train with.
"""

from __future__ import annotations

import copy
import json
import logging
import os

from shardwise.config import load_config

from .runner import TrialResult, TrialRunner, find_config_arg
from .space import (Experiment, accepted_stages, memory_budget_per_rank, micro_batch_candidates, prune_by_memory,
                    with_stage)
from .tuners import TUNERS

logger = logging.getLogger("shardwise")

_METRICS = {"throughput": ("samples/s", True), "latency": ("ms/step", False), "flops": ("FLOP/s per rank", True)}
_NON_FAST_BUCKETS = (5e7, 2e8)  # extra reduce_bucket_size values tried for the best stage when fast is false


def _precision(cfg) -> str:
    return "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"


def _monitors_off(cfg: dict) -> None:
    """Trials do not write into the user's TensorBoard/CSV/W&B logs."""
    for key in ("tensorboard", "csv_monitor", "wandb"):
        if isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], "enabled": False}


class Autotuner:
    def __init__(self, opts, *, num_procs: int, trial_timeout: float = 900.0) -> None:
        self.opts = opts
        self.num_procs = num_procs
        self.num_nodes = opts.num_nodes or 1
        self.dp = num_procs * self.num_nodes
        _, config_path = find_config_arg(opts.script_args)
        try:
            with open(config_path) as f:
                self.raw = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--deepspeed_config {config_path}: {exc}") from None
        if not isinstance(self.raw, dict):
            raise ValueError(f"--deepspeed_config {config_path}: the config must be a JSON object")
        validated = with_stage(self.raw, accepted_stages(self.raw)[0])
        self.cfg = load_config(validated)  # everything but the stage list is checked here
        self.at = self.cfg.autotuning
        if self.at.mp_size != 1:
            raise ValueError(f"autotuning.mp_size = {self.at.mp_size}: model parallelism is not implemented yet; use 1")
        self.metric_unit, self.higher_is_better = _METRICS[self.at.metric]
        self.runner = TrialRunner(opts=opts, exps_dir=self.at.exps_dir, timeout=trial_timeout,
                                  arg_mappings=self.at.arg_mappings, overwrite=self.at.overwrite)
        try:  # keep the user's accumulation steps (as the batch triad resolves them at this world size)
            self.grad_accum = self.cfg.resolve_batch_sizes(self.dp).gradient_accumulation_steps
        except ValueError:
            self.grad_accum = self.cfg.gradient_accumulation_steps or 1
        self.results: list[TrialResult] = []

    # -- configs ---------------------------------------------------------------------------
    def _trial_config(self, exp: Experiment, metric_path: str) -> dict:
        cfg = with_stage(self.raw, exp.stage)
        cfg["zero_optimization"].update(exp.zero_overrides)
        cfg.pop("train_batch_size", None)
        cfg["train_micro_batch_size_per_gpu"] = exp.micro_batch
        cfg["gradient_accumulation_steps"] = self.grad_accum
        _monitors_off(cfg)
        at = dict(self.raw.get("autotuning", {}))
        start, end = self.at.start_profile_step, max(self.at.end_profile_step, self.at.start_profile_step + 1)
        if self.at.metric == "flops":  # profile one step before the timed window
            start, end = max(start, 2), max(end, max(start, 2) + 1)
            cfg["flops_profiler"] = {"enabled": True, "profile_step": 1, "detailed": False, "top_modules": 0,
                                     "output_file": os.path.join(os.path.dirname(metric_path), "flops.txt")}
        at.update(enabled=True, metric_path=metric_path, start_profile_step=start, end_profile_step=end)
        at.pop("model_info", None)
        cfg["autotuning"] = at
        return cfg

    def optimal_config(self, best: TrialResult) -> dict:
        with open(os.path.join(best.exp_dir, "ds_config.json")) as f:
            cfg = json.load(f)
        cfg.pop("autotuning", None)
        for key in ("flops_profiler", "tensorboard", "csv_monitor", "wandb"):  # the user's own blocks back
            if key in self.raw:
                cfg[key] = copy.deepcopy(self.raw[key])
            else:
                cfg.pop(key, None)
        return cfg

    # -- steps -----------------------------------------------------------------------------
    def num_params(self) -> int:
        info = self.at.model_info
        if info is not None and info.num_params:
            return int(info.num_params)
        path = os.path.abspath(os.path.join(self.at.exps_dir, "model_info", "model_info.json"))
        cfg = with_stage(self.raw, 0)
        cfg.pop("train_batch_size", None)
        cfg["train_micro_batch_size_per_gpu"] = self.at.min_train_micro_batch_size_per_gpu
        cfg["gradient_accumulation_steps"] = self.grad_accum
        _monitors_off(cfg)
        cfg["autotuning"] = {**self.raw.get("autotuning", {}), "enabled": True,
                             "model_info": {"profile": True}, "model_info_path": path}
        result = self.runner.run("model_info", cfg, metric_file="model_info.json")
        if result.metrics is None:
            raise RuntimeError(f"autotune: the model-info run failed ({result.status}); see {result.exp_dir}/stdout.log")
        logger.info("autotuning: the model has %d parameters", result.metrics["num_params"])
        return int(result.metrics["trainable_num_params"])

    def experiments(self, num_params: int) -> list[Experiment]:
        stages = accepted_stages(self.raw)
        budget, kind = memory_budget_per_rank(self.num_procs)
        stages = prune_by_memory(stages, num_params=num_params, precision=_precision(self.cfg),
                                 dp_world_size=self.dp, num_gpus=self.num_procs, num_nodes=self.num_nodes,
                                 budget=budget)
        if not stages:
            raise RuntimeError(f"autotune: no ZeRO stage fits the model states of {num_params} parameters in "
                               f"{budget / 2**30:.2f} GiB of {kind} per rank")
        sizes = micro_batch_candidates(self.at, dp_world_size=self.dp, grad_accum=self.grad_accum)
        return [Experiment(s, m) for s in stages for m in sizes]

    def tune(self) -> TrialResult | None:
        exps = self.experiments(self.num_params())
        logger.info("autotuning: %d candidate experiments (stages %s, micro-batch sizes %s)", len(exps),
                    sorted({e.stage for e in exps}), sorted({e.micro_batch for e in exps}))
        tuner = TUNERS[self.at.tuner_type](exps, higher_is_better=self.higher_is_better,
                                           num_trials=self.at.tuner_num_trials,
                                           early_stopping=self.at.tuner_early_stopping)
        self._run_tuner(tuner)
        best = self.best()
        if not self.at.fast and best is not None:  # also try other gradient bucket sizes for the best point
            stage, mbs = best.settings["stage"], best.settings["micro_batch"]
            extra = [Experiment(stage, mbs, {"reduce_bucket_size": b}) for b in _NON_FAST_BUCKETS]
            self._run_tuner(TUNERS["gridsearch"](extra, higher_is_better=self.higher_is_better,
                                                 num_trials=len(extra), early_stopping=0))
            best = self.best()
        logger.info("autotuning: stopped: %s", tuner.stop_reason)
        return best

    def _run_tuner(self, tuner) -> None:
        while (exp := tuner.next()) is not None:
            metric_path = os.path.abspath(os.path.join(self.at.exps_dir, exp.name, "metrics.json"))
            settings = {"stage": exp.stage, "micro_batch": exp.micro_batch, "grad_accum": self.grad_accum,
                        **exp.zero_overrides}
            result = self.runner.run(exp.name, self._trial_config(exp, metric_path), metric_file="metrics.json",
                                     settings=settings)
            value = self._value(result)
            logger.info("autotuning: %s: %s%s", exp.name, result.status,
                        f", {self.at.metric} {value:.4g} {self.metric_unit}" if value is not None else "")
            self.results.append(result)
            tuner.record(exp, value)

    def _value(self, r: TrialResult) -> float | None:
        if r.metrics is None:
            return None
        v = r.metrics.get(self.at.metric)
        return float(v) if v is not None else None

    def best(self) -> TrialResult | None:
        ok = [r for r in self.results if self._value(r) is not None]
        if not ok:
            return None
        key = lambda r: self._value(r)  # noqa: E731
        return max(ok, key=key) if self.higher_is_better else min(ok, key=key)
