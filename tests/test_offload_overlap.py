"""The offloaded optimizer step overlapped with backward (docs/zero.md, "Offload"): bitwise the same
training as the step after backward, at ZeRO 2 and 3 with CPU and NVMe offload; and it really
overlaps: a sub-group's step starts while backward is still running (seen from inside backward),
and with NVMe the read of sub-group k+1 and the write of k-1 are issued before the step of k ends."""

from __future__ import annotations

import time

import torch

from distributed import run_distributed, run_subtests

STEPS, BATCH = 3, 8


class _SeeStepDuringBackward(torch.autograd.Function):
    """Identity whose backward (the last of the model's backward: it sits at the input) waits, when an
    overlapped step is under way, up to 20 s for the optimizer's own trace to show a sub-group step
    started; it records what it saw."""

    part = None
    seen: list[bool] = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        part, deadline = _SeeStepDuringBackward.part, time.monotonic() + 20
        if part is not None:
            armed = part._overlap is not None
            while armed and part.trace.first("step_start") is None and time.monotonic() < deadline:
                time.sleep(0.002)
            _SeeStepDuringBackward.seen.append(armed and part.trace.first("step_start") is not None)
        return g


class _Deep(torch.nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        layers = [torch.nn.Linear(7, 16), torch.nn.Tanh()]
        for _ in range(6):
            layers += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
        self.body = torch.nn.Sequential(*layers, torch.nn.Linear(16, 3))

    def forward(self, x):
        x = x.requires_grad_() if not x.requires_grad else x
        return self.body(_SeeStepDuringBackward.apply(x))


def _config(stage, device, nvme_dir, *, fp16=False, gas=1):
    z = {"stage": stage, "reduce_bucket_size": 60, "sub_group_size": 120,
         "offload_optimizer": {"device": device, "nvme_path": nvme_dir, "buffer_count": 2}}
    if stage == 3:
        z.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
    cfg = {"train_micro_batch_size_per_gpu": BATCH // 2 // gas, "gradient_accumulation_steps": gas,
           "gradient_clipping": 0.0, "zero_optimization": z,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}
    if fp16:  # a huge first loss scale: the first steps overflow and are skipped
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 17, "hysteresis": 1}
    return cfg


def _train(case, rank, world, nvme_dir):
    import shardwise
    from shardwise.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    stage, device, fp16, gas, overlap = case
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(STEPS, BATCH, 7, generator=g), torch.randn(STEPS, BATCH, 3, generator=g)
    model = _Deep()
    engine, *_ = shardwise.initialize(model=model, config=_config(stage, device, nvme_dir, fp16=fp16, gas=gas))
    part = engine.strategy.partition
    part.overlap_step = overlap
    _SeeStepDuringBackward.part, _SeeStepDuringBackward.seen = part, []
    per, micro = BATCH // world, BATCH // world // gas
    dtype = torch.float16 if fp16 else torch.float32
    losses, skipped = [], 0
    for s in range(STEPS):
        for m in range(gas):
            xs = x[s, rank * per + m * micro:rank * per + (m + 1) * micro].to(dtype)
            ys = y[s, rank * per + m * micro:rank * per + (m + 1) * micro].to(dtype)
            loss = torch.nn.functional.mse_loss(engine(xs).float(), ys.float())
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        skipped += engine.was_step_skipped()
    events = list(part.trace.events)  # the last step's
    params = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    states = {n: safe_get_full_optimizer_state(p, "exp_avg_sq") for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "states": states, "events": events, "skipped": skipped,
            "seen": list(_SeeStepDuringBackward.seen), "subgroups": len(part.subgroups)}


CASES = [(stage, device, False, gas, overlap) for stage, device, gas in
         [(2, "cpu", 2), (2, "nvme", 1), (3, "cpu", 1), (3, "nvme", 2)] for overlap in (True, False)]
CASES += [(2, "cpu", True, 1, True), (2, "cpu", True, 1, False)]


def _body(rank, world, nvme_dir):
    return dict(zip(CASES, run_subtests(_train, CASES, rank, world, nvme_dir)))


def _first(events, name, index=-1):
    return next(t for t, e, i in events if e == name and (index < 0 or i == index))


def test_overlapped_offload_step_is_bitwise_the_plain_step_and_overlaps(tmp_path):
    results = run_distributed(_body, 2, args=(str(tmp_path / "nvme"),), timeout=240)
    for r in results:
        for case in CASES:
            stage, device, fp16, gas, overlap = case
            if not overlap:
                continue
            on, off = r[case], r[(stage, device, fp16, gas, False)]
            assert on["losses"] == off["losses"], case
            for n in on["params"]:  # bitwise: same kernels, same coefficient, same order within a tensor
                assert torch.equal(on["params"][n], off["params"][n]), (case, n)
                assert torch.equal(on["states"][n], off["states"][n]), (case, n)
            assert on["subgroups"] >= 3, case
            ev = on["events"]
            if fp16:
                # A step that may be skipped (fp16 overflow check) is never stepped during backward ...
                assert 1 <= on["skipped"] < STEPS and on["skipped"] == off["skipped"], case
                assert not any(on["seen"]) and not any(e == "backward_end" for _, e, _ in ev), case
                continue
            # ... a step that cannot is: from inside backward's last op, a sub-group step was seen to
            # start, at every boundary backward but the first (the first step learns the clipping and
            # loss scale), and the recorded events put the first sub-group step before backward's end.
            expected = [i >= gas and i % gas == gas - 1 for i in range(STEPS * gas)]
            assert on["seen"] == expected, (case, on["seen"])
            steps = sorted({i for _, e, i in ev if e == "step_start"})
            assert steps == list(range(on["subgroups"])), (case, steps)
            assert _first(ev, "step_start", 0) < _first(ev, "backward_end"), case
            assert not any(off["seen"]), case
            if device == "nvme":  # read of k+1 and write of k-1 issued before the step of k ends
                for k in range(on["subgroups"]):
                    if k + 1 < on["subgroups"]:
                        assert _first(ev, "read", k + 1) < _first(ev, "step_end", k), (case, k)
                    if k >= 1:
                        assert _first(ev, "write", k - 1) < _first(ev, "step_end", k), (case, k)
                    if k >= 1:
                        assert _first(ev, "step_start", k) > _first(ev, "step_end", k - 1), (case, k)
