"""Monitoring, profiling, autotuning and elasticity blocks."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import ConfigModel, Float, Int

__all__ = [
    "TensorBoardConfig", "CSVMonitorConfig", "WandbConfig", "CometConfig", "CommsLoggerConfig",
    "FlopsProfilerConfig", "AutotuningConfig", "ModelInfoConfig", "ElasticityConfig", "TimersConfig",
]


class TensorBoardConfig(ConfigModel):
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class CSVMonitorConfig(ConfigModel):
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(ConfigModel):
    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


class CometConfig(ConfigModel):
    enabled: bool = False
    samples_log_interval: Int = Field(100, gt=0)
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: bool | None = None
    mode: str | None = None


class ThroughputTimerConfig(ConfigModel):
    """``timers.throughput``: ``engine.tput_timer``; ``synchronized`` waits for the device around each timing."""

    enabled: bool = True
    synchronized: bool = True


class TimersConfig(ConfigModel):
    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)


class CommsLoggerConfig(ConfigModel):
    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    debug: bool = False
    prof_ops: list[str] = Field(default_factory=list)


class FlopsProfilerConfig(ConfigModel):
    enabled: bool = False
    recompute_fwd_factor: Float = Field(0.0, ge=0)
    profile_step: Int = Field(1, ge=1)
    module_depth: Int = -1
    top_modules: Int = Field(1, ge=0)
    detailed: bool = True
    output_file: str | None = None


class ModelInfoConfig(ConfigModel):
    profile: bool = False
    num_params: Int | None = None
    hidden_size: Int | None = None
    num_layers: Int | None = None


class AutotuningConfig(ConfigModel):
    enabled: bool = False
    fast: bool = True
    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: bool = True
    start_profile_step: Int = Field(3, ge=0)
    end_profile_step: Int = Field(5, ge=0)
    metric_path: str | None = None
    metric: Literal["throughput", "latency", "flops"] = "throughput"
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    tuner_early_stopping: Int = Field(5, ge=0)
    tuner_num_trials: Int = Field(50, gt=0)
    arg_mappings: dict[str, str] | None = None
    max_train_batch_size: Int | None = Field(None, gt=0)
    min_train_batch_size: Int = Field(1, gt=0)
    max_train_micro_batch_size_per_gpu: Int = Field(1024, gt=0)
    min_train_micro_batch_size_per_gpu: Int = Field(1, gt=0)
    num_tuning_micro_batch_sizes: Int = Field(3, gt=0)
    mp_size: Int = Field(1, gt=0)
    model_info_path: str | None = None
    model_info: ModelInfoConfig | None = None


class ElasticityConfig(ConfigModel):
    enabled: bool = False
    max_train_batch_size: Int = Field(2000, gt=0)
    micro_batch_sizes: list[Int] = Field(default_factory=lambda: [2, 4, 6])
    min_gpus: Int = Field(1, gt=0)
    max_gpus: Int = Field(10000, gt=0)
    min_time: Int = Field(0, ge=0)
    prefer_larger_batch: bool = True
    ignore_non_elastic_batch_info: bool = False
    version: Float = 0.2
    num_gpus_per_node: Int = Field(1, gt=0)
    model_parallel_size: Int = Field(1, gt=0)
