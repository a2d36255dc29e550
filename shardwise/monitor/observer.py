"""What the engine calls at the edges of a training step to make it visible.

``StepObserver.before_forward(global_steps)`` runs at the start of every ``engine(...)`` call and
``after_step(report)`` after every optimizer step.  The observer sees the engine only through a
``TrainingState`` (built once) and the ``StepReport`` of each step (``shardwise/training_state.py``);
autotuning's trial recorder, which reads batch settings, is handed the engine itself. Between them they drive the monitors
(TensorBoard / CSV / W&B events from rank 0), the flops profiler (``flops_profiler`` block)
and autotuning trials (``autotuning`` block written by ``shardwise autotune``).
"""

from __future__ import annotations

import logging
import time

import torch

from shardwise import comm
from shardwise.training_state import StepReport, TrainingState

from . import MonitorMaster

logger = logging.getLogger("shardwise")

# engine timer name -> monitor tag suffix (DeepSpeed's names)
_TIMER_TAGS = {
    "forward": "elapsed_time_ms_forward",
    "backward": "elapsed_time_ms_backward",
    "backward_inner": "elapsed_time_ms_backward_inner",
    "backward_allreduce": "elapsed_time_ms_backward_allreduce",
    "step": "elapsed_time_ms_step",
}


class StepObserver:
    def __init__(self, state: TrainingState, *, autotuning_engine=None) -> None:
        cfg = state.config
        self.state = state
        engine = autotuning_engine
        self.monitor = MonitorMaster(cfg, rank=state.global_rank)
        self.flops = None
        self.last_flops_profile = None  # the finished FlopsProfiler, for programmatic access (rank 0)
        fp = cfg.flops_profiler
        if fp.enabled and state.global_rank == 0:
            from shardwise.profiling.flops import FlopsProfiler

            self.flops = FlopsProfiler(state.module, recompute_fwd_factor=fp.recompute_fwd_factor)
        self.trial = None
        at = cfg.autotuning
        if at.enabled:
            from shardwise.autotuning import recorder

            if at.model_info is not None and at.model_info.profile and at.model_info_path:
                recorder.write_model_info_and_exit(engine)
            if at.metric_path:
                self.trial = recorder.TrialRecorder(engine)
            elif state.global_rank == 0:
                logger.warning("autotuning.enabled without autotuning.metric_path does nothing inside training; "
                               "run 'shardwise autotune ...' to tune")
        self._step_begin: float | None = None
        self._last_end: float | None = None
        self.meter = _throughput_meter(state)  # tokens/s and MFU (monitor/mfu.py)

    # -- hooks -----------------------------------------------------------------------------
    def before_forward(self, global_steps: int, args=(), kwargs=None) -> None:
        if self.meter is not None:
            self.meter.observe(args, kwargs or {})
        if self._step_begin is None:
            self._step_begin = time.perf_counter()
        fp = self.state.config.flops_profiler
        if self.flops is not None and not self.flops.started and global_steps == fp.profile_step:
            self.flops.start_profile()

    def after_step(self, report: StepReport) -> None:
        now = time.perf_counter()
        begin = self._last_end if self._last_end is not None else (self._step_begin or now)
        step_time = now - begin
        self._last_end = now
        if self.meter is not None:
            self.meter.step_done()
        if self.flops is not None and self.flops.started:
            self._report_flops(report.global_steps)
        if self.monitor.enabled:
            self._write_step_events(report, step_time)
        if self.trial is not None:
            self.trial.after_step()

    def rates(self, key: str) -> dict:
        """tokens/s and MFU since the last call with ``key`` ({} without a meter); the reason MFU is
        missing is logged once."""
        if self.meter is None:
            return {}
        r = self.meter.rates(key)
        if self.state.global_rank == 0:
            self.meter.say_once(r.get("why"))
        return r

    # -- pieces ----------------------------------------------------------------------------
    def _report_flops(self, global_steps: int) -> None:
        fp = self.state.config.flops_profiler
        prof = self.flops
        prof.stop_profile()
        step = global_steps - 1  # the step that was profiled (0-based, as profile_step)
        prof.print_model_profile(profile_step=step, module_depth=fp.module_depth, top_modules=fp.top_modules,
                                 detailed=fp.detailed, output_file=fp.output_file)
        if self.trial is not None:
            self.trial.step_flops = prof.forward_flops + prof.backward_flops + prof.other_flops
        self.last_flops_profile, self.flops = prof, None  # one profile per run, as in DeepSpeed

    def _mean_loss(self, loss: float | None) -> float | None:
        """The loss averaged over data-parallel ranks (a collective: every rank calls this)."""
        s = self.state
        if loss is None or s.dp_world_size == 1:
            return loss
        t = torch.tensor([loss], dtype=torch.float64, device=s.device)
        comm.all_reduce(t, group=s.dp_group)
        return float(t.item()) / s.dp_world_size

    def _write_step_events(self, r: StepReport, step_time: float) -> None:
        loss = self._mean_loss(r.loss)
        if self.state.global_rank != 0:
            return
        x = r.global_samples
        events = [("Train/Samples/lr", r.lr, x)]
        if loss is not None:
            events.insert(0, ("Train/Samples/train_loss", loss, x))
        if r.loss_scale is not None:
            events.append(("Train/Samples/loss_scale", r.loss_scale, x))
        if r.grad_norm is not None:
            events.append(("Train/Samples/grad_norm", r.grad_norm, x))
        if step_time > 0:
            events.append(("Train/Samples/samples_per_sec", r.batch_size / step_time, x))
            events.append(("Train/Samples/step_time_ms", 1000.0 * step_time, x))
        rates = self.meter.rates("monitor") if self.meter is not None else {}
        if rates.get("tokens_per_sec") is not None:
            events.append(("Train/Samples/tokens_per_sec", rates["tokens_per_sec"], x))
        if rates.get("mfu") is not None:
            events.append(("Train/Samples/mfu", rates["mfu"], x))
        if r.timings is not None:
            last = dict(r.timings)
            if "backward" in last:
                last["backward_inner"] = last["backward"] - last.get("backward_allreduce", 0.0)
            events.extend((f"Train/Samples/{tag}", 1000.0 * last[name], x)
                          for name, tag in _TIMER_TAGS.items() if name in last)
        self.monitor.write_events(events)


def _throughput_meter(state: TrainingState):
    """The step's token counter and MFU arithmetic for this run (None if the model cannot be measured)."""
    from shardwise.monitor import mfu

    try:
        grid = state.grid
        tensor = getattr(grid, "get_tensor_model_parallel_world_size", lambda: 1)()
        sequence = getattr(grid, "get_sequence_parallel_world_size", lambda: 1)()
        flops = mfu.model_flops(state.module, tensor_size=tensor)
        peak, source = mfu.peak_flops(mfu.device_name(state.device),
                                      mfu.training_dtype_name(state.precision.param_dtype),
                                      override_tflops=getattr(state.config, "peak_tflops", None))
        return mfu.ThroughputMeter(flops, replicas=state.dp_world_size, world=comm.get_world_size(), peak=peak,
                                   peak_source=source, sequence_parallel=sequence)
    except Exception as exc:  # noqa: BLE001 - the figures are optional; training must not stop for them
        logger.debug("tokens/s and MFU disabled: %s", exc)
        return None
