"""Tests of shardwise.config against /work/shared/CONFIG_REFERENCE.md and the DeepSpeed batch rules."""

from __future__ import annotations

import ast
import itertools
import json
import logging
import sys
import warnings
from pathlib import Path

import pytest

from shardwise.config import BatchSizes, ConfigError, ShardwiseConfig, load_config

CONFIG_DIR = Path(__file__).resolve().parents[1] / "shardwise" / "config"


def load_quiet(data):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(data)


def get(cfg, path):
    value = cfg
    for part in path.split("."):
        value = getattr(value, part)
    return value


# Transcribed from CONFIG_REFERENCE.md (key path -> documented default).
REFERENCE_DEFAULTS = {
    "train_batch_size": None, "train_micro_batch_size_per_gpu": None, "gradient_accumulation_steps": None,
    "steps_per_print": None, "wall_clock_breakdown": False, "memory_breakdown": False, "dump_state": False,
    "optimizer": None, "scheduler": None,
    "zero_allow_untested_optimizer": False, "zero_force_ds_cpu_optimizer": True,
    "amp.enabled": False, "torch_autocast.enabled": False, "torch_autocast.dtype": "bf16",
    "gradient_clipping": 1.0, "communication_data_type": None, "prescale_gradients": False,
    "gradient_predivide_factor": 1.0, "gradient_allreduce_op": "mean",
    "sparse_gradients": False, "disable_allgather": False,
    "aio.block_size": 1048576, "aio.queue_depth": 8, "aio.thread_count": 1, "aio.single_submit": False,
    "aio.overlap_events": True,
    "activation_checkpointing.partition_activations": False, "activation_checkpointing.cpu_checkpointing": False,
    "activation_checkpointing.contiguous_memory_optimization": False,
    "activation_checkpointing.number_checkpoints": None,
    "activation_checkpointing.synchronize_checkpoint_boundary": False, "activation_checkpointing.profile": False,
    "pipeline.activation_checkpoint_interval": 0, "pipeline.pipe_partitioned": True,
    "pipeline.grad_partitioned": True,
    "flops_profiler.enabled": False, "flops_profiler.recompute_fwd_factor": 0.0, "flops_profiler.profile_step": 1,
    "flops_profiler.module_depth": -1, "flops_profiler.top_modules": 1, "flops_profiler.detailed": True,
    "flops_profiler.output_file": None,
    "tensorboard.enabled": False, "tensorboard.output_path": "", "tensorboard.job_name": "DeepSpeedJobName",
    "csv_monitor.enabled": False, "csv_monitor.output_path": "", "csv_monitor.job_name": "DeepSpeedJobName",
    "wandb.enabled": False, "wandb.group": None, "wandb.team": None, "wandb.project": "deepspeed",
    "comet.enabled": False, "comet.samples_log_interval": 100,
    "comms_logger.enabled": False, "comms_logger.verbose": False, "comms_logger.prof_all": True,
    "comms_logger.debug": False, "comms_logger.prof_ops": [],
    "autotuning.enabled": False, "autotuning.fast": True, "autotuning.results_dir": "autotuning_results",
    "autotuning.exps_dir": "autotuning_exps", "autotuning.overwrite": True, "autotuning.start_profile_step": 3,
    "autotuning.end_profile_step": 5, "autotuning.metric_path": None, "autotuning.metric": "throughput",
    "autotuning.tuner_type": "gridsearch", "autotuning.tuner_early_stopping": 5,
    "autotuning.tuner_num_trials": 50, "autotuning.arg_mappings": None, "autotuning.max_train_batch_size": None,
    "autotuning.min_train_batch_size": 1, "autotuning.max_train_micro_batch_size_per_gpu": 1024,
    "autotuning.min_train_micro_batch_size_per_gpu": 1, "autotuning.num_tuning_micro_batch_sizes": 3,
    "autotuning.mp_size": 1, "autotuning.model_info_path": None,
    "elasticity.enabled": False, "elasticity.max_train_batch_size": 2000, "elasticity.micro_batch_sizes": [2, 4, 6],
    "elasticity.min_gpus": 1, "elasticity.max_gpus": 10000, "elasticity.min_time": 0,
    "elasticity.prefer_larger_batch": True, "elasticity.ignore_non_elastic_batch_info": False,
    "elasticity.version": 0.2, "elasticity.num_gpus_per_node": 1, "elasticity.model_parallel_size": 1,
    "checkpoint.tag_validation": "Warn", "checkpoint.load_universal": False,
    "checkpoint.use_node_local_storage": False, "checkpoint.parallel_write.pipeline_stage": False,
    "data_types.grad_accum_dtype": None, "dataloader_drop_last": False,
    "zero_optimization.stage": 0, "zero_optimization.contiguous_gradients": True,
    "zero_optimization.reduce_scatter": True, "zero_optimization.reduce_bucket_size": 5 * 10**8,
    "zero_optimization.allgather_partitions": True, "zero_optimization.allgather_bucket_size": 5 * 10**8,
    "zero_optimization.overlap_comm": False, "zero_optimization.load_from_fp32_weights": True,
    "zero_optimization.elastic_checkpoint": False, "zero_optimization.offload_param": None,
    "zero_optimization.offload_optimizer": None, "zero_optimization.sub_group_size": 10**9,
    "zero_optimization.stage3_prefetch_bucket_size": 5 * 10**7,
    "zero_optimization.stage3_param_persistence_threshold": 10**5,
    "zero_optimization.stage3_model_persistence_threshold": sys.maxsize,
    "zero_optimization.stage3_max_live_parameters": 10**9, "zero_optimization.stage3_max_reuse_distance": 10**9,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    "zero_optimization.ignore_unused_parameters": True, "zero_optimization.round_robin_gradients": False,
    "zero_optimization.zero_hpz_partition_size": 1, "zero_optimization.zero_quantized_weights": False,
    "zero_optimization.zero_quantized_gradients": False, "zero_optimization.mics_shard_size": -1,
    "zero_optimization.use_multi_rank_bucket_allreduce": True, "zero_optimization.memory_efficient_linear": True,
    "fp16.enabled": False, "fp16.auto_cast": False, "fp16.loss_scale": 0, "fp16.initial_scale_power": 16,
    "fp16.loss_scale_window": 1000, "fp16.hysteresis": 2, "fp16.consecutive_hysteresis": False,
    "fp16.min_loss_scale": 1, "fp16.fp16_master_weights_and_grads": False,
    "bf16.enabled": False, "bf16.immediate_grad_update": False, "bf16.check_grad_overflow": True,
    "bf16.bf16_master_weights_and_grads": False, "bf16.bf16_optimizer_states": False,
}
OFFLOAD_PARAM_DEFAULTS = {"device": "none", "nvme_path": None, "buffer_count": 5, "buffer_size": 10**8,
                          "max_in_cpu": 10**9, "pin_memory": True}
OFFLOAD_OPTIMIZER_DEFAULTS = {"device": "none", "nvme_path": None, "buffer_count": 4, "pin_memory": True,
                              "pipeline_read": False, "pipeline_write": False, "fast_init": False, "ratio": 1.0}
REMOVED_BLOCKS = ("eigenvalue", "progressive_layer_drop", "curriculum_learning")
OTHER_BLOCKS = ["expert_parallel", "hybrid_engine", "compile", "sparse_attention", "eigenvalue",
                "progressive_layer_drop", "data_efficiency", "curriculum_learning", "compression_training",
                "nebula"]


# ---------------------------------------------------------------- defaults

@pytest.mark.parametrize("path", sorted(REFERENCE_DEFAULTS))
def test_defaults_match_reference(path):
    assert get(load_config({}), path) == REFERENCE_DEFAULTS[path]


def test_offload_block_defaults_match_reference():
    cfg = load_config({"zero_optimization": {"offload_param": {}, "offload_optimizer": {}}})
    for name, expected in OFFLOAD_PARAM_DEFAULTS.items():
        assert getattr(cfg.zero_optimization.offload_param, name) == expected, name
    for name, expected in OFFLOAD_OPTIMIZER_DEFAULTS.items():
        assert getattr(cfg.zero_optimization.offload_optimizer, name) == expected, name


def test_other_blocks_accepted_and_off_by_default():
    cfg = load_config({name: {"enabled": False} for name in OTHER_BLOCKS})
    cfg.check_supported()


def test_overlap_comm_default_depends_on_stage():
    assert load_config({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    assert load_config({"zero_optimization": {"stage": 2}}).zero_optimization.overlap_comm is False
    assert load_config({"zero_optimization": {"stage": 3, "overlap_comm": False}}).zero_optimization.overlap_comm \
        is False


def test_to_dict_is_json_and_round_trips():
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "loss_scale": 128},
                       "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "betas": [0.8, 0.9]}},
                       "zero_optimization": {"offload_optimizer": {"device": "none"}}})
    data = json.loads(json.dumps(cfg.to_dict()))
    again = load_config(data)
    assert again == cfg
    assert data["fp16"]["loss_scale"] == 128 and data["optimizer"]["params"]["betas"] == [0.8, 0.9]


# ---------------------------------------------------------------- batch triad

def _triad_cases():
    for dp, micro, gas in itertools.product((1, 2, 4), (1, 3), (1, 2, 5)):
        tbs = micro * gas * dp
        full = {"train_batch_size": tbs, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}
        for keys in itertools.chain.from_iterable(itertools.combinations(full, r) for r in (1, 2, 3)):
            if keys == ("gradient_accumulation_steps",):
                continue
            given = {k: full[k] for k in keys}
            if "gradient_accumulation_steps" not in given and not ("train_batch_size" in given and
                                                                   "train_micro_batch_size_per_gpu" in given):
                # DeepSpeed: accumulation defaults to 1 unless the other two determine it
                expected = (micro * dp, micro, 1) if "train_micro_batch_size_per_gpu" in given else (tbs, tbs // dp, 1)
            else:
                expected = (tbs, micro, gas)
            yield dp, given, expected


@pytest.mark.parametrize("dp,given,expected", list(_triad_cases()))
def test_triad_inference(dp, given, expected):
    batch = load_config(given).resolve_batch_sizes(dp)
    assert isinstance(batch, BatchSizes)
    assert tuple(batch) == expected
    assert batch.train_batch_size == (batch.train_micro_batch_size_per_gpu
                                      * batch.gradient_accumulation_steps * dp)


def test_triad_mismatch_spells_out_arithmetic():
    cfg = load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    with pytest.raises(ConfigError) as info:
        cfg.resolve_batch_sizes(2)
    assert str(info.value) == ("train_batch_size (32) != train_micro_batch_size_per_gpu (4) * "
                               "gradient_accumulation_steps (2) * data-parallel world size (2) = 16")


@pytest.mark.parametrize("given,dp,must_mention", [
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2, ["(30)", "(4)", "(2)", "= 8"]),
    ({"train_batch_size": 30, "gradient_accumulation_steps": 4}, 2, ["(30)", "(4)", "(2)", "= 8",
                                                                     "train_micro_batch_size_per_gpu"]),
    ({"train_batch_size": 30}, 4, ["(30)", "data-parallel world size (4)"]),
    ({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4}, 2, ["(4)", "(2)", "= 8"]),
])
def test_triad_not_divisible(given, dp, must_mention):
    with pytest.raises(ConfigError) as info:
        load_config(given).resolve_batch_sizes(dp)
    for piece in must_mention:
        assert piece in str(info.value)
    assert "not divisible" in str(info.value)


@pytest.mark.parametrize("given", [{}, {"gradient_accumulation_steps": 4}])
def test_triad_needs_a_batch_size(given):
    with pytest.raises(ConfigError, match="train_batch_size or train_micro_batch_size_per_gpu"):
        load_config(given).resolve_batch_sizes(1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_triad_rejects_bad_world_size(bad):
    with pytest.raises(ValueError, match="dp_world_size"):
        load_config({"train_micro_batch_size_per_gpu": 1}).resolve_batch_sizes(bad)


def test_triad_logs_inferred_value(caplog):
    with caplog.at_level(logging.INFO, logger="shardwise"):
        load_config({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}).resolve_batch_sizes(4)
    assert any("train_batch_size inferred: 24" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"])
@pytest.mark.parametrize("bad", [0, -3])
def test_triad_values_must_be_positive(key, bad):
    with pytest.raises(ConfigError, match=f"^{key}: expected a value > 0"):
        load_config({key: bad})


# ---------------------------------------------------------------- unknown keys

@pytest.mark.parametrize("config,path,suggestion", [
    ({"gradient_clipp1ng": 1.0}, "gradient_clipp1ng", "gradient_clipping"),
    ({"zero_optimization": {"reduce_bucket_sise": 1}}, "zero_optimization.reduce_bucket_sise", "reduce_bucket_size"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memroy": True}}},
     "zero_optimization.offload_optimizer.pin_memroy", "pin_memory"),
    ({"checkpoint": {"parallel_write": {"pipeline_stag": True}}}, "checkpoint.parallel_write.pipeline_stag",
     "pipeline_stage"),
    ({"fp16": {"initial_scale_pow": 8}}, "fp16.initial_scale_pow", "initial_scale_power"),
    ({"tensorboard": {"outputpath": "runs"}}, "tensorboard.outputpath", "output_path"),
])
def test_unknown_key_names_path_and_suggestion(config, path, suggestion):
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert str(info.value).startswith(f"{path}: unknown key")
    assert f"did you mean '{suggestion}'" in str(info.value)


def test_unknown_key_at_wrong_level_points_to_its_block():
    with pytest.raises(ConfigError, match=r"reduce_bucket_size: .*zero_optimization\.reduce_bucket_size"):
        load_config({"reduce_bucket_size": 100})


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config({"gradient_clipp1ng": 1, "zero_optimization": {"stage": "two"}, "fp16": {"enabled": "maybe"}})
    assert len(info.value.problems) == 3
    text = str(info.value)
    for piece in ("gradient_clipp1ng", "zero_optimization.stage", "fp16.enabled"):
        assert piece in text


# ---------------------------------------------------------------- types

def test_wrong_type_names_path():
    with pytest.raises(ConfigError) as info:
        load_config({"zero_optimization": {"reduce_bucket_size": "big"}})
    assert str(info.value) == "zero_optimization.reduce_bucket_size: expected an integer, got 'big'"


@pytest.mark.parametrize("config,start", [
    ({"train_batch_size": True}, "train_batch_size: expected an integer, got true"),
    ({"gradient_clipping": "x"}, "gradient_clipping: must be a number, got 'x'"),
    ({"wall_clock_breakdown": "sometimes"}, "wall_clock_breakdown: expected true or false"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage: expected a value <= 3, got 4"),
    ({"zero_optimization": {"offload_param": {"device": "gpu"}}}, "zero_optimization.offload_param.device: expected"),
    ({"gradient_allreduce_op": "max"}, "gradient_allreduce_op: Invalid gradient_allreduce_op 'max': expected 'mean' or 'sum'"),
    ({"communication_data_type": "int8"}, "communication_data_type: expected one of 'fp32', 'fp16', 'bf16'"),
    ({"fp16": 3}, "fp16: expected an object"),
    ({"optimizer": {"params": {}}}, "optimizer.type: required key is missing"),
    ({"zero_optimization": {"allgather_bucket_size": 5.5}}, "zero_optimization.allgather_bucket_size: expected an"),
])
def test_wrong_values_are_explained(config, start):
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert str(info.value).startswith(start)


@pytest.mark.parametrize("config,first", [
    ({"zero_optimization": {"stage": 2, "zenflow": {}}}, "'sum' is not supported with ZenFlow"),
    ({"compile": {"deepcompile": True}}, "'sum' is not supported with DeepCompile"),
])
def test_sum_allreduce_with_zenflow_or_deepcompile_is_refused_in_deepspeed_words_first(config, first):
    with pytest.raises(ConfigError) as info:
        load_config({"gradient_allreduce_op": "sum", **config})
    assert info.value.problems[0] == f"gradient_allreduce_op: {first}" + (
        " (zero_optimization.zenflow)" if "ZenFlow" in first else " (compile.deepcompile)")
    assert len(info.value.problems) == 2  # and the feature itself, refused on its own
    with pytest.raises(ConfigError) as alone:
        load_config(config)
    assert alone.value.problems == info.value.problems[1:]


def test_bucket_sizes_written_as_floats_become_ints():
    zero = load_config({"zero_optimization": {"reduce_bucket_size": 5e8, "allgather_bucket_size": 2e8}}).zero_optimization
    assert zero.reduce_bucket_size == 500_000_000 and isinstance(zero.reduce_bucket_size, int)
    assert zero.allgather_bucket_size == 200_000_000 and isinstance(zero.allgather_bucket_size, int)


# One type rule: JSON types as DeepSpeed documents them, "auto" where HF writes it.
@pytest.mark.parametrize("config,path,expected", [
    ({"train_batch_size": "32"}, "train_batch_size", "an integer"),
    ({"bf16": {"enabled": "yes"}}, "bf16.enabled", "true or false"),
    ({"bf16": {"enabled": "on"}}, "bf16.enabled", "true or false"),
    ({"bf16": {"enabled": 2}}, "bf16.enabled", "true or false"),
    ({"fp16": {"enabled": "true"}}, "fp16.enabled", "true or false"),
    ({"gradient_clipping": "1.5"}, "gradient_clipping", "a number"),
    ({"zero_optimization": {"stage": "2"}}, "zero_optimization.stage", "an integer"),
    ({"zero_optimization": {"offload_optimizer": {"ratio": "0.5"}}}, "zero_optimization.offload_optimizer.ratio",
     "a number"),
    ({"steps_per_print": "10"}, "steps_per_print", "a positive integer"),
    ({"gradient_clipping": float("nan")}, "gradient_clipping", ""),
])
def test_no_silent_coercion(config, path, expected):
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert str(info.value).startswith((f"{path}: expected {expected}", f"{path}: must be {expected}")), str(info.value)


def _leaf_fields(model, prefix=""):
    """(path, kind) of every bool / int / float key of the config models, recursively."""
    from shardwise.config.loader import _members, _submodel
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        sub = _submodel(field.annotation)
        if sub is not None:
            yield from _leaf_fields(sub, path)
            continue
        members = set(_members(field.annotation))
        for kind in (bool, int, float):
            if kind in members:
                yield path, kind
                break


def _nest(path, value):
    out = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


def test_every_scalar_key_refuses_strings_and_bools_as_numbers():
    """The rule holds for every boolean and numeric key, not only a few named ones."""
    leaves = list(_leaf_fields(ShardwiseConfig))
    assert len(leaves) > 80
    for path, kind in leaves:
        wrong = {bool: ["true", 2, -1, 1.0, "on"], int: ["3", True], float: ["0.5", False]}[kind]
        for value in wrong:
            with pytest.raises(ConfigError) as info:
                load_quiet(_nest(path, value))
            assert path in str(info.value), (path, value, str(info.value))


def _value_at(cfg, path):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_every_boolean_key_takes_0_and_1():
    """pydantic's lax bool, as in DeepSpeed: 0 and 1 are false and true (``"zero_allow_untested_optimizer": 1``)."""
    for path in [p for p, kind in _leaf_fields(ShardwiseConfig) if kind is bool]:
        for value in (0, 1):
            try:
                got = _value_at(load_quiet(_nest(path, value)), path)
            except ConfigError as exc:  # a setting refused (an unimplemented feature): refused as true/false is
                assert str(exc) == _refusal(_nest(path, bool(value))), (path, str(exc))
                continue
            assert got is bool(value), (path, value, got)


def _refusal(config):
    with pytest.raises(ConfigError) as info:
        load_quiet(config)
    return str(info.value)


def test_auto_and_infinity_stay_accepted():
    cfg = load_config({"train_batch_size": "auto", "bf16": {"enabled": "auto"},
                       "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
                       "gradient_clipping": "auto", "steps_per_print": float("inf")})
    assert cfg.train_batch_size is None and cfg.bf16.enabled is False
    assert cfg.steps_per_print == float("inf")  # accelerate's "never print"
    assert load_config(json.loads(json.dumps(cfg.to_dict()))).steps_per_print == float("inf")


@pytest.mark.parametrize("spelling,expected", [
    ("fp32", "fp32"), ("float32", "fp32"), ("torch.float32", "fp32"), ("fp16", "fp16"), ("float16", "fp16"),
    ("half", "fp16"), ("bf16", "bf16"), ("bfloat16", "bf16"), ("BFloat16", "bf16"),
])
def test_communication_data_type_spellings(spelling, expected):
    assert load_config({"communication_data_type": spelling}).communication_data_type == expected


def test_case_insensitive_choices():
    cfg = load_config({"gradient_allreduce_op": "SUM", "checkpoint": {"tag_validation": "fail"},
                       "zero_optimization": {"offload_optimizer": {"device": "CPU"}}})
    assert cfg.gradient_allreduce_op == "sum"
    assert cfg.checkpoint.tag_validation == "Fail"
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


# ---------------------------------------------------------------- "auto"

def test_auto_means_unset_and_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="shardwise"):
        cfg = load_config({
            "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "fp16": {"enabled": "auto", "loss_scale_window": "auto"},
            "zero_optimization": {"stage": 3, "overlap_comm": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "eps": 1e-6}},
        })
    assert cfg.train_batch_size is None and cfg.gradient_accumulation_steps is None
    assert cfg.gradient_clipping == REFERENCE_DEFAULTS["gradient_clipping"]
    assert cfg.fp16.enabled is False and cfg.fp16.loss_scale_window == REFERENCE_DEFAULTS["fp16.loss_scale_window"]
    assert cfg.zero_optimization.overlap_comm is True  # derived: stage 3
    assert cfg.optimizer.params == {"eps": 1e-6}
    assert cfg.resolve_batch_sizes(3) == (6, 2, 1)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for path in ("train_batch_size", "gradient_accumulation_steps", "gradient_clipping", "fp16.enabled",
                 "fp16.loss_scale_window", "zero_optimization.overlap_comm", "optimizer.params.lr"):
        assert f"{path}: \"auto\"" in logged, path
    assert 'gradient_clipping: "auto" -> 1.0' in logged


HF_STYLE = {
    "fp16": {"enabled": "auto", "auto_cast": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 0, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                          "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def test_hugging_face_style_config_loads(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(HF_STYLE, indent=4))
    cfg = load_config(str(path))
    assert cfg.fp16.enabled is False and cfg.bf16.enabled is False and cfg.fp16.auto_cast is False
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.params == {}
    assert cfg.scheduler.type == "WarmupLR" and cfg.scheduler.params == {}
    assert cfg.zero_optimization.reduce_bucket_size == 200_000_000
    assert cfg.zero_optimization.overlap_comm is True
    assert cfg.steps_per_print == 2000
    cfg.check_supported()
    # the same file with the Trainer's values filled in
    filled = dict(HF_STYLE, train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=4,
                  fp16=dict(HF_STYLE["fp16"], enabled=True))
    cfg = load_config(filled)
    assert cfg.fp16.enabled is True
    assert cfg.resolve_batch_sizes(2) == (64, 8, 4)


# ---------------------------------------------------------------- deprecated aliases

def _load_recording(config):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(config)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize("config,replacement,check", [
    ({"bfloat16": {"enabled": True}}, "bf16", lambda c: c.bf16.enabled),
    ({"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}},
     "zero_optimization.stage3_gather_16bit_weights_on_model_save",
     lambda c: c.zero_optimization.stage3_gather_16bit_weights_on_model_save),
    ({"zero_optimization": {"cpu_offload": True}}, "zero_optimization.offload_optimizer",
     lambda c: c.zero_optimization.offload_optimizer.device == "cpu" and c.zero_optimization.offload_param is None),
    ({"zero_optimization": {"stage": 3, "cpu_offload_param": True}}, "zero_optimization.offload_param",
     lambda c: c.zero_optimization.offload_param.device == "cpu"),
    ({"zero_optimization": True}, '"stage": 1', lambda c: c.zero_optimization.stage == 1),
    ({"zero_optimization": False}, '"stage": 0', lambda c: c.zero_optimization.stage == 0),
])
def test_deprecated_alias_warns_once_and_names_replacement(config, replacement, check):
    cfg, messages = _load_recording(config)
    assert len(messages) == 1, messages
    assert "deprecated" in messages[0] and replacement in messages[0]
    assert check(cfg)


def test_cpu_offload_pin_memory_alias_applies_to_offload_blocks():
    cfg, messages = _load_recording({"zero_optimization": {"cpu_offload": True, "cpu_offload_use_pin_memory": False}})
    assert len(messages) == 2
    assert cfg.zero_optimization.offload_optimizer.pin_memory is False


def test_offload_param_below_stage_3_is_ignored_with_a_warning():
    """DeepSpeed ignores it there; DeepSpeed-Chat's --offload writes both offload blocks at any stage."""
    for stage in (0, 1, 2):
        cfg, messages = _load_recording({"zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"},
                                                               "offload_optimizer": {"device": "cpu"}}})
        assert cfg.zero_optimization.offload_param.device == "cpu"  # kept, as DeepSpeed's config keeps it
        assert cfg.zero_optimization.offload_optimizer.device == "cpu"
        assert len(messages) == 1 and "offload_param is ignored" in messages[0] and f"stage is {stage}" in messages[0]
    cfg, messages = _load_recording({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    assert cfg.zero_optimization.offload_param.device == "cpu" and not messages
    cfg, messages = _load_recording({"zero_optimization": {"stage": 2, "offload_param": {"device": "none"}}})
    assert not messages


def test_zero_stage3_keys_by_deepspeed_field_name():
    cfg, messages = _load_recording({"zero_optimization": {"stage": 3, "max_live_parameters": 7,
                                                           "param_persistence_threshold": 5,
                                                           "gather_16bit_weights_on_model_save": True,
                                                           "zero_quantized_nontrainable_weights": False}})
    z = cfg.zero_optimization
    assert (z.stage3_max_live_parameters, z.stage3_param_persistence_threshold) == (7, 5) and not messages
    assert z.stage3_gather_16bit_weights_on_model_save
    with pytest.raises(ConfigError, match="prefetch_bucket_size and zero_optimization.stage3_prefetch_bucket_size"):
        load_quiet({"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}})


@pytest.mark.parametrize("config", [
    {"bfloat16": {"enabled": True}, "bf16": {"enabled": True}},
    {"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
])
def test_alias_and_replacement_together_is_an_error(config):
    with pytest.raises(ConfigError, match="both given"):
        load_quiet(config)


# ---------------------------------------------------------------- precision rules

def test_fp16_and_bf16_together_is_an_error():
    with pytest.raises(ConfigError, match=r"fp16\.enabled and bf16\.enabled"):
        load_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"fp16\.enabled and bf16\.enabled"):
        load_quiet({"fp16": {"enabled": True}, "bfloat16": {"enabled": True}})


@pytest.mark.parametrize("key", ["loss_scale", "initial_scale_power", "hysteresis", "auto_cast"])
def test_fp16_only_key_inside_bf16_is_an_error(key):
    with pytest.raises(ConfigError, match=rf"^bf16\.{key}: .*fp16-only"):
        load_config({"bf16": {"enabled": True, key: 1}})


def test_amp_conflicts():
    with pytest.raises(ConfigError, match="amp.enabled"):
        load_config({"amp": {"enabled": True}, "fp16": {"enabled": True}})
    with pytest.raises(ConfigError, match="amp.enabled"):
        load_config({"amp": {"enabled": True}, "zero_optimization": {"stage": 1}})


# ---------------------------------------------------------------- files

def test_json_syntax_error_names_file_line_and_column(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    line3 = path.read_text().splitlines()[2]
    column = line3.index(",}") + 2  # json reports the position of the "}" after the trailing comma (1-based)
    assert str(info.value).startswith(f"{path}:3:{column}: invalid JSON")


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "ds_config.json"
    with pytest.raises(ConfigError, match="not found") as info:
        load_config(str(missing))
    assert str(missing) in str(info.value)


def test_duplicate_json_key_is_an_error(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError, match="duplicate key 'train_batch_size'"):
        load_config(path)


def test_problems_in_a_file_name_the_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": "x"}}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: zero_optimization.stage: expected an integer")


def test_load_config_inputs(tmp_path):
    cfg = load_config({"steps_per_print": 5})
    assert load_config(cfg) is cfg
    with pytest.raises(ConfigError, match="load_config"):
        load_config(42)
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="top level must be a JSON object"):
        load_config(path)


# ---------------------------------------------------------------- check_supported

NOT_YET = [  # (config snippet, key path that must be named)
    ({"comet": {"enabled": True}}, "comet"),
    ({"amp": {"enabled": True, "opt_level": "O1"}}, "amp.enabled"),
    ({"activation_checkpointing": {"contiguous_memory_optimization": True}},
     "activation_checkpointing.contiguous_memory_optimization"),
    ({"checkpoint": {"use_node_local_storage": True}}, "checkpoint.use_node_local_storage"),
    ({"hybrid_engine": {"enabled": True, "inference_tp_size": 2}}, "hybrid_engine.inference_tp_size"),
    # data_efficiency's random-LTD and curriculum sampling are implemented; dynamic batching is not
    ({"data_efficiency": {"enabled": True, "data_sampling": {"dynamic_batching": {"enabled": True}}}},
     "data_efficiency.data_sampling.dynamic_batching"),
] + [({name: {"enabled": True}}, name) for name in OTHER_BLOCKS
     if name not in ("sparse_attention", "compile", "expert_parallel", "hybrid_engine", "data_efficiency",
                     *REMOVED_BLOCKS)]


@pytest.mark.parametrize("config,path", NOT_YET)
def test_check_supported_names_each_feature(config, path):
    cfg = load_config(config)
    with pytest.raises(ConfigError) as info:
        cfg.check_supported()
    assert info.value.problems[0].startswith(f"not implemented yet: {path}")
    assert len(info.value.problems) == 1


def test_check_supported_lists_every_feature():
    cfg = load_config({"sparse_gradients": True, "comet": {"enabled": True},
                       "amp": {"enabled": True}, "hybrid_engine": {"enabled": True, "inference_tp_size": 2}})
    with pytest.raises(ConfigError) as info:
        cfg.check_supported()
    text = str(info.value)
    for path in ("comet", "amp.enabled", "hybrid_engine.inference_tp_size"):
        assert f"not implemented yet: {path}" in text
    assert "sparse_gradients: removed from DeepSpeed" in text
    assert len(info.value.problems) == 4


@pytest.mark.parametrize("config,key,instead", [
    ({"sparse_gradients": True}, "sparse_gradients", "reduced dense"),
    ({"eigenvalue": {"enabled": True}}, "eigenvalue", "delete the block"),
    ({"progressive_layer_drop": {"enabled": True, "theta": 0.5}}, "progressive_layer_drop", "delete the block"),
    ({"curriculum_learning": {"enabled": True}}, "curriculum_learning",
     "data_efficiency.data_sampling.curriculum_learning"),
])
def test_removed_blocks_refused_as_removed(config, key, instead):
    """DeepSpeed 0.19.8 refuses these four as removed; so does shardwise, naming what replaces each."""
    with pytest.raises(ConfigError) as info:
        load_config(config).check_supported()
    (problem,) = info.value.problems
    assert problem.startswith(f"{key}: removed from DeepSpeed") and instead in problem
    assert not problem.startswith("not implemented")
    load_config({key: False if key == "sparse_gradients" else {"enabled": False}}).check_supported()


def test_supported_features_pass():
    cfg = load_config({
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10,
        "wall_clock_breakdown": True, "dump_state": True,
        "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10}},
        "fp16": {"enabled": True, "auto_cast": True, "loss_scale": 0}, "gradient_clipping": 0.5,
        "communication_data_type": "fp32", "prescale_gradients": True, "gradient_predivide_factor": 2.0,
        "gradient_allreduce_op": "sum", "dataloader_drop_last": True, "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False, "checkpoint": {"tag_validation": "Fail"},
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 1000, "overlap_comm": True,
                              "contiguous_gradients": False, "offload_optimizer": {"device": "none"}},
        "data_types": {"grad_accum_dtype": "fp32"}, "compile": {"enabled": False, "backend": "inductor"},
        "pipeline": {"stages": "auto"},
    })
    cfg.check_supported()
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "Lion", "RMSprop"):
        load_config({"optimizer": {"type": name}}).check_supported()


# ---------------------------------------------------------------- packaging

def test_config_package_never_imports_torch():
    for path in CONFIG_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            assert not any(n == "torch" or n.startswith("torch.") for n in names), (path, names)


def test_config_object_type():
    assert isinstance(load_config({}), ShardwiseConfig)


def test_docs_not_implemented_table_matches_code():
    """docs/config.md's "Not implemented yet" table names exactly the code's NOT_IMPLEMENTED keys (no more, no
    fewer: a key listed there that works would mislead)."""
    import re
    from shardwise.config.support import NOT_IMPLEMENTED
    text = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    section = text.split("## Not implemented yet", 1)[1].split("\n## ", 1)[0]
    listed = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            first_column = line.split(" | ")[0]
            listed.update(re.findall(r"`([a-z_0-9.]+)`", first_column))
    assert listed == set(NOT_IMPLEMENTED), (listed ^ set(NOT_IMPLEMENTED))
    load_config({"tensorboard": {"enabled": True, "output_path": "tb"}}).check_supported()


@pytest.mark.parametrize("param_dtype,blocks,ok", [
    ("bf16", {"bf16": {"enabled": True}}, True), ("float16", {"fp16": {"enabled": True}}, True),
    ("fp32", {}, True), ("fp16", {"bf16": {"enabled": True}}, False), ("bf16", {}, False)])
def test_data_types_param_dtype_must_agree_with_fp16_bf16(param_dtype, blocks, ok):
    cfg = {"train_batch_size": 1, "data_types": {"param_dtype": param_dtype, "buffer_dtype": "fp32"}, **blocks}
    if ok:
        assert load_config(cfg).data_types.buffer_dtype == "fp32"
    else:
        with pytest.raises(ConfigError, match="data_types.param_dtype=.* conflicts with the enabled precision"):
            load_config(cfg)


def test_data_types_keep_in_fp32_modules_is_auto_or_names():
    assert load_config({"train_batch_size": 1}).data_types.keep_in_fp32_modules == "auto"
    assert load_config({"train_batch_size": 1, "data_types": {"keep_in_fp32_modules": ["a.*"]}}) \
        .data_types.keep_in_fp32_modules == ["a.*"]
    with pytest.raises(ConfigError, match="keep_in_fp32_modules"):
        load_config({"train_batch_size": 1, "data_types": {"keep_in_fp32_modules": "everything"}})


def test_hjson_config_file_as_deepspeed_reads_it(tmp_path):
    """DeepSpeed reads config files as hjson (comments, unquoted keys, no commas); so does shardwise
    when the hjson package is there (the compat package requires it), else the error says what to install."""
    path = tmp_path / "ds_config.json"
    path.write_text("{\n  # a comment\n  train_batch_size: 8\n  fp16: {enabled: true}\n}\n")
    try:
        import hjson  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"ds_config.json:2:3: invalid JSON: .*needs the hjson package"):
            load_config(path)
        return
    cfg = load_config(path)
    assert cfg.train_batch_size == 8 and cfg.fp16.enabled is True
    path.write_text("{\n  train_batch_size: 8\n  train_batch_size: 8\n}\n")
    with pytest.raises(ConfigError, match="duplicate key 'train_batch_size'"):
        load_config(path)


def test_fp16_dynamic_scaler_settings_checked_only_when_it_is_on():
    """As DeepSpeed: loss_scale_window / min_loss_scale must be > 0 for dynamic loss scaling, and are
    unused (any value) with a static loss scale or fp16 off."""
    for fp16 in ({"enabled": True, "loss_scale": 128}, {"enabled": False}):
        assert load_config({"fp16": {**fp16, "loss_scale_window": 0, "min_loss_scale": -1}}).fp16.loss_scale_window == 0
    with pytest.raises(ConfigError, match=r"fp16.loss_scale_window and fp16.min_loss_scale must be > 0 when dynamic"):
        load_config({"fp16": {"enabled": True, "loss_scale_window": 0, "min_loss_scale": 0}})
