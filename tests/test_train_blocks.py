"""Issue 31's training blocks: ``timers``, ``torch_autocast`` and ``data_types.grad_accum_dtype``."""

from __future__ import annotations

import pytest
import torch

from models import base_config, make_data, make_model, mse


# ---------------------------------------------------------------- timers

@pytest.mark.parametrize("enabled", [True, False])
def test_timers_throughput_switches_the_tput_timer(enabled):
    import shardwise

    cfg = base_config(timers={"throughput": {"enabled": enabled, "synchronized": False}})
    engine, _, _, _ = shardwise.initialize(model=make_model(), config=cfg)
    assert engine.config.timers.throughput.synchronized is False
    x, y = make_data(4, 4)
    for s in range(4):
        engine.backward(mse(engine(x[s]), y[s]))
        engine.step()
    timer = engine.tput_timer
    assert timer.enabled is enabled
    assert timer.global_step_count == (4 if enabled else 0)
    assert (timer.avg_samples_per_sec() > 0) is enabled  # -inf when off, as DeepSpeed's


def test_timers_defaults_and_unknown_key():
    from shardwise.config import ConfigError, load_config

    cfg = load_config({})
    assert cfg.timers.throughput.enabled is True and cfg.timers.throughput.synchronized is True
    with pytest.raises(ConfigError, match="timers.throughput.synchronised"):
        load_config({"timers": {"throughput": {"synchronised": True}}})
