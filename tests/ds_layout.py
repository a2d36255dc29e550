"""Write DeepSpeed-layout checkpoint folders from known values, without DeepSpeed.

Follows DeepSpeed 0.19's ``runtime/engine.py`` (``_save_checkpoint``, ``_common_checkpoint_state``,
``_save_zero_checkpoint``), ``runtime/zero/stage_1_and_2.py`` (``state_dict``: flat fp32 groups
padded to a multiple of 2 x world and cut into equal partitions, the padding dropped from the
saved fp32 partition but not from the Adam moments), ``runtime/bf16_optimizer.py`` (the same
without dropping padding, ``bf16_`` file prefix), ``runtime/zero/stage3.py`` (``_rigid_state_dict``:
each parameter cut into ``ceil(numel / world)`` pieces, sub-groups of ``fp32_flat_groups``),
``runtime/fp16/{fused,unfused}_optimizer.py`` (ZeRO-0 with fp16/bf16) and ``utils/zero_to_fp32.py``.
DeepSpeed's classes pickled into the files (loss scalers, ``ZeroStageEnum``,
``fragment_address``) are look-alikes registered under DeepSpeed's module names while saving.
"""

from __future__ import annotations

import contextlib
import enum
import math
import sys
import types
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

_MODULES = ["deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16", "deepspeed.runtime.fp16.loss_scaler",
            "deepspeed.runtime.zero", "deepspeed.runtime.zero.config", "deepspeed.utils",
            "deepspeed.utils.tensor_fragment"]


class LossScaler:
    def __init__(self, scale: float) -> None:
        self.cur_scale = scale
        self.dynamic = False


class DynamicLossScaler:
    def __init__(self, scale: float, cur_iter: int, last_overflow_iter: int, hysteresis: int) -> None:
        self.cur_scale = scale
        self.cur_iter = cur_iter
        self.last_overflow_iter = last_overflow_iter
        self.scale_factor = 2.0
        self.scale_window = 1000
        self.min_scale = 1
        self.delayed_shift = 2
        self.cur_hysteresis = hysteresis
        self.consecutive_hysteresis = False
        self.raise_error_at_min_scale = True
        self.dynamic = True
        self.dtype = torch.float16


ZeroStageEnum = enum.IntEnum("ZeroStageEnum", {"disabled": 0, "optimizer_states": 1, "gradients": 2, "weights": 3},
                             module="deepspeed.runtime.zero.config")


@dataclass
class fragment_address:  # noqa: N801 (DeepSpeed's name)
    numel: int
    start: int


for _cls, _mod in [(LossScaler, "deepspeed.runtime.fp16.loss_scaler"),
                   (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler"),
                   (fragment_address, "deepspeed.utils.tensor_fragment")]:
    _cls.__module__ = _mod


@contextlib.contextmanager
def _deepspeed_names():
    """Make the look-alikes importable under DeepSpeed's names while pickling."""
    assert not any(m in sys.modules for m in _MODULES), "the real deepspeed is imported here"
    mods = {name: types.ModuleType(name) for name in _MODULES}
    mods["deepspeed.runtime.fp16.loss_scaler"].LossScaler = LossScaler
    mods["deepspeed.runtime.fp16.loss_scaler"].DynamicLossScaler = DynamicLossScaler
    mods["deepspeed.runtime.zero.config"].ZeroStageEnum = ZeroStageEnum
    mods["deepspeed.utils.tensor_fragment"].fragment_address = fragment_address
    sys.modules.update(mods)
    try:
        yield
    finally:
        for name in _MODULES:
            sys.modules.pop(name, None)


@dataclass
class Source:
    """What the DeepSpeed job held when it saved (all fp32, whole tensors)."""

    weights: dict[str, torch.Tensor]  # every parameter (trainable and frozen)
    buffers: dict[str, torch.Tensor]
    groups: list[list[str]]  # trainable names per param group, in flat (bit16_groups) order
    moments: dict[str, dict[str, torch.Tensor]]  # name -> {"exp_avg": ..., "exp_avg_sq": ...}
    hyper: list[dict]  # per group: lr, betas, eps, weight_decay, ...
    step: int = 5
    shared: dict[str, str] = field(default_factory=dict)  # alias -> parameter name
    scheduler: dict | None = None
    client: dict = field(default_factory=dict)
    scaler: object = None  # LossScaler / DynamicLossScaler (fp16)
    global_samples: int = 40

    @property
    def frozen(self) -> list[str]:
        trainable = {n for g in self.groups for n in g}
        return [n for n in self.weights if n not in trainable]


def make_source(seed: int = 0, *, groups: int = 2, scheduler=True, scaler=None) -> Source:
    g = torch.Generator().manual_seed(seed)
    shapes = {"emb.weight": (5, 3), "fc1.weight": (7, 3), "fc1.bias": (7,), "fc2.weight": (3, 7),
              "fc2.bias": (3,), "frozen": (4,)}
    weights = {n: torch.randn(*s, generator=g) for n, s in shapes.items()}
    trainable = [n for n in shapes if n != "frozen"]
    split = [trainable[:3], trainable[3:]] if groups == 2 else [trainable]
    moments = {n: {"exp_avg": torch.randn(*shapes[n], generator=g),
                   "exp_avg_sq": torch.rand(*shapes[n], generator=g)} for n in trainable}
    hyper = [{"lr": 0.01 * (i + 1), "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1 * i, "amsgrad": False,
              "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None}
             for i in range(len(split))]
    return Source(weights=weights, buffers={"norm": torch.linspace(0, 1, 3)}, groups=split, moments=moments,
                  hyper=hyper, shared={"head.weight": "emb.weight"},
                  scheduler={"last_batch_iteration": 4} if scheduler else None,
                  client={"epoch": 3, "pos": (1, 2), "t": torch.arange(4.0)}, scaler=scaler)


class SynthNet(torch.nn.Module):
    """A model with the names of :func:`make_source` (tied ``head.weight``, a frozen parameter, a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.fc1 = torch.nn.Linear(3, 7)
        self.fc2 = torch.nn.Linear(7, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.register_buffer("norm", torch.zeros(3))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.tanh(self.fc1(self.emb(idx)))) + self.norm
        return self.head(h) + self.frozen.sum()


def _module(src: Source, dtype, placeholders: bool) -> OrderedDict:
    sd = OrderedDict()
    for n, w in src.weights.items():
        sd[n] = torch.empty(0, dtype=dtype) if placeholders else w.to(dtype)
        if n == "emb.weight":
            for alias, target in src.shared.items():
                if target == n:
                    sd[alias] = sd[n]  # tied: the same tensor under two names
    sd.update({n: b.clone() for n, b in src.buffers.items()})
    return sd


def _model_states(src: Source, *, stage: int, world: int, dtype, module, optimizer, ds_config: dict,
                  frozen_fragments=None) -> dict:
    zero = stage > 0
    states = dict(
        module=module, buffer_names=list(src.buffers), optimizer=optimizer,
        param_shapes=[OrderedDict((n, torch.Size(src.weights[n].shape)) for n in g) for g in src.groups]
        if zero else None,
        frozen_param_shapes=OrderedDict((n, torch.Size(src.weights[n].shape)) for n in src.frozen)
        if stage >= 2 else None,
        shared_params=dict(src.shared) if zero else None,
        frozen_param_fragments=frozen_fragments if stage >= 2 else None,
        lr_scheduler=src.scheduler, data_sampler=None, random_ltd=None, skipped_steps=1, global_steps=src.step,
        global_samples=src.global_samples, dp_world_size=world, mp_world_size=1,
        checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 1}, ds_config=ds_config, ds_version="0.19.8")
    states.update(src.client)
    return states


def _config(stage: int, dtype) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.9, 0.95], "torch_adam": True}}}
    if dtype == torch.float16:
        cfg["fp16"] = {"enabled": True, "hysteresis": 2}
    elif dtype == torch.bfloat16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _param_groups(src: Source, params: list[list[int]]) -> list[dict]:
    return [{**h, "params": p} for h, p in zip(src.hyper, params)]


def write(root, src: Source, *, stage: int, world: int, dtype=torch.float32, tag: str = "global_step5",
          elastic: bool = False, fused_fp16: bool = False, sub_groups: int = 2, edit_optim=None) -> Path:
    """A DeepSpeed checkpoint of ``src`` at ``root/tag`` (+ ``root/latest``); returns the tag folder.
    ``edit_optim(rank, optimizer_state_dict)`` may change a ZeRO optimizer file before it is written
    (to fake another DeepSpeed version's layout)."""
    folder = Path(root) / tag
    folder.mkdir(parents=True, exist_ok=True)
    cfg = _config(stage, dtype)
    with _deepspeed_names():
        if stage == 0:
            _write_stage0(folder, src, dtype, cfg, fused_fp16)
        elif stage in (1, 2):
            _write_stage12(folder, src, stage, world, dtype, cfg, elastic, edit_optim)
        else:
            _write_stage3(folder, src, world, dtype, cfg, sub_groups, edit_optim)
    (Path(root) / "latest").write_text(tag)
    return folder


def _step() -> torch.Tensor:
    return torch.tensor(5.0)


def _write_stage0(folder, src, dtype, cfg, fused):
    names = [n for g in src.groups for n in g]
    if dtype == torch.float32:  # the torch optimizer itself, per-parameter state
        ids = [[names.index(n) for n in g] for g in src.groups]
        opt = {"state": {names.index(n): {"step": _step(), **src.moments[n]} for n in names},
               "param_groups": _param_groups(src, ids)}
    elif fused:  # FP16_Optimizer: one flat fp32 tensor per group
        flat = lambda g, f: torch.cat([f(n).reshape(-1) for n in g])  # noqa: E731
        opt = {"optimizer_state_dict": {
            "state": {i: {"step": _step(),
                          **{k: flat(g, lambda n, k=k: src.moments[n][k]) for k in ("exp_avg", "exp_avg_sq")}}
                      for i, g in enumerate(src.groups)},
            "param_groups": _param_groups(src, [[i] for i in range(len(src.groups))])},
            "fp32_groups_flat": [flat(g, lambda n: src.weights[n]) for g in src.groups], "clip_grad": 0.0}
    else:  # FP16_UnfusedOptimizer: per-parameter fp32 copies
        ids = [[names.index(n) for n in g] for g in src.groups]
        opt = {"optimizer_state_dict": {"state": {names.index(n): {"step": _step(), **src.moments[n]} for n in names},
                                        "param_groups": _param_groups(src, ids)},
               "fp32_groups": [[src.weights[n].clone() for n in g] for g in src.groups], "clip_grad": 0.0}
    if dtype == torch.float16:
        scaler = src.scaler
        opt.update(dynamic_loss_scale=scaler.dynamic, cur_scale=scaler.cur_scale,
                   cur_iter=getattr(scaler, "cur_iter", 0),
                   last_overflow_iter=getattr(scaler, "last_overflow_iter", -1),
                   scale_factor=2.0, scale_window=1000)
    # ZeRO-0 has no 'shared_params': a tied weight is the same tensor under two names in 'module'
    torch.save(_model_states(src, stage=0, world=1, dtype=dtype, module=_module(src, dtype, False), optimizer=opt,
                             ds_config=cfg), folder / "mp_rank_00_model_states.pt")


def _write_stage12(folder, src, stage, world, dtype, cfg, elastic, edit):
    bf16_optimizer = dtype == torch.bfloat16 and stage == 1
    torch.save(_model_states(src, stage=stage, world=world, dtype=dtype, module=_module(src, dtype, False),
                             optimizer=None, ds_config=cfg,
                             frozen_fragments=OrderedDict((n, src.weights[n].to(dtype)) for n in src.frozen)),
               folder / "mp_rank_00_model_states.pt")
    layouts = []
    for g in src.groups:  # flatten_dense_tensors_aligned(..., 2 * world): padding at the end
        total = sum(src.weights[n].numel() for n in g)
        aligned = math.ceil(total / (2 * world)) * 2 * world
        pad = lambda t: torch.cat([t, torch.zeros(aligned - total)])  # noqa: E731
        flat = {"w": pad(torch.cat([src.weights[n].reshape(-1) for n in g]))}
        for k in ("exp_avg", "exp_avg_sq"):
            flat[k] = pad(torch.cat([src.moments[n][k].reshape(-1) for n in g]))
        layouts.append((g, total, aligned, flat))
    for r in range(world):
        parts, states, paddings, mappings = [], [], [], []
        for g, total, aligned, flat in layouts:
            size = aligned // world
            lo, hi = r * size, (r + 1) * size
            padding = aligned - total if r == world - 1 else 0
            part = flat["w"][lo:hi]
            parts.append(part if bf16_optimizer else part[:size - padding])
            moments = {k: flat[k][lo:hi] for k in ("exp_avg", "exp_avg_sq")}
            if elastic:
                moments = {k: v[:size - padding] for k, v in moments.items()}
            states.append(moments)
            paddings.append(padding)
            mapping, off = OrderedDict(), 0
            for n in g:
                a, b = max(off, lo), min(off + src.weights[n].numel(), hi)
                if a < b:
                    mapping[n] = fragment_address(numel=b - a, start=a - lo)
                off += src.weights[n].numel()
            mappings.append(mapping)
        if elastic:
            base = states
        else:
            base = {"state": {i: {"step": _step(), **s} for i, s in enumerate(states)},
                    "param_groups": _param_groups(src, [[i] for i in range(len(states))])}
        osd = {"clip_grad": 0.0, "base_optimizer_state": base, "single_partition_of_fp32_groups": parts,
               "group_paddings": paddings, "partition_count": [world] * len(parts), "ds_version": "0.19.8",
               "param_slice_mappings": mappings}
        if elastic:
            osd["base_optimizer_state_step"] = 5
        if not bf16_optimizer:
            osd.update(loss_scaler=src.scaler or LossScaler(1.0),
                       dynamic_loss_scale=bool(getattr(src.scaler, "dynamic", False)),
                       overflow=False, zero_stage=ZeroStageEnum(stage),
                       param_alignment_paddings=[[0] * len(g) for g, *_ in layouts])
        if edit is not None:
            edit(r, osd)
        name = f"{'bf16_' if bf16_optimizer else ''}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        torch.save({"optimizer_state_dict": osd, "ds_config": cfg, "ds_version": "0.19.8"}, folder / name)


def _piece(t: torch.Tensor, r: int, world: int) -> torch.Tensor:
    n = t.numel()
    pn = math.ceil(n / world)
    padded = torch.cat([t.reshape(-1), torch.zeros(pn * world - n)])
    return padded[r * pn:(r + 1) * pn]


def _write_stage3(folder, src, world, dtype, cfg, sub_groups, edit):
    # sub-groups of whole parameters, in order, never across a param group
    subs = []
    for gi, g in enumerate(src.groups):
        k = max(1, math.ceil(len(g) / max(1, sub_groups // len(src.groups))))
        subs += [(gi, g[i:i + k]) for i in range(0, len(g), k)]
    for r in range(world):
        frozen = OrderedDict((n, _piece(src.weights[n], r, world).to(dtype)) for n in src.frozen)
        torch.save(_model_states(src, stage=3, world=world, dtype=dtype, module=_module(src, dtype, True),
                                 optimizer=None, ds_config=cfg, frozen_fragments=frozen),
                   folder / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        flats = [torch.cat([_piece(src.weights[n], r, world) for n in ns]) for _, ns in subs]
        state = {i: {"step": _step(), **{k: torch.cat([_piece(src.moments[n][k], r, world) for n in ns])
                                         for k in ("exp_avg", "exp_avg_sq")}} for i, (_, ns) in enumerate(subs)}
        params = [[i for i, (gi, _) in enumerate(subs) if gi == g] for g in range(len(src.groups))]
        osd = {"zero_stage": ZeroStageEnum(3), "loss_scaler": src.scaler or LossScaler(1.0),
               "dynamic_loss_scale": bool(getattr(src.scaler, "dynamic", False)), "overflow": False,
               "partition_count": world, "optimizer_state_dict": {"state": state,
                                                                  "param_groups": _param_groups(src, params)},
               "fp32_flat_groups": flats}
        if edit is not None:
            edit(r, osd)
        torch.save({"optimizer_state_dict": osd, "ds_config": cfg, "ds_version": "0.19.8"},
                   folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
