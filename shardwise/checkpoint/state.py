"""Small pieces of engine state a checkpoint carries: RNG states, data position, tied names."""

from __future__ import annotations

import json
import random

import numpy as np
import torch

from shardwise.checkpoint.serialize import join_state, split_state


def rng_state() -> tuple[dict, dict[str, torch.Tensor]]:
    """This process's python / numpy / torch (and accelerator) RNG states as JSON + tensors."""
    np_state = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(np_state[1].astype(np.int64))}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state()
    meta = {"python": split_state(random.getstate(), "python")[0],
            "numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])]}
    return meta, tensors


def set_rng_state(meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    random.setstate(join_state(meta["python"], {}))
    name, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])


def data_position(engine) -> dict | None:
    """``{"epoch", "consumed"}`` of the engine's training loader, when it keeps one."""
    loader = engine.training_dataloader
    if loader is None or not hasattr(loader, "state_dict"):
        return None
    return loader.state_dict()


def restore_data_position(engine, state: dict | None) -> None:
    loader = engine.training_dataloader
    if state is not None and loader is not None and hasattr(loader, "load_state_dict"):
        loader.load_state_dict(state)


def tied_names(module: torch.nn.Module) -> dict[str, str]:
    """``{alias: name}`` for state-dict entries that are the same tensor as an earlier one
    (tied weights); ``name`` is the one ``named_parameters()`` reports."""
    params = {id(p): n for n, p in module.named_parameters()}
    first: dict[int, str] = {}
    aliases = {}
    for key, t in module.state_dict(keep_vars=True).items():
        owner = first.setdefault(id(t), params.get(id(t), key))
        if owner != key:
            aliases[key] = owner
    return aliases


def optimizer_groups(engine) -> list[dict]:
    """Hyper-parameters of each param group (lr, betas, ...); which tensors belong to a group is
    decided by the strategy that loads, so only the settings are kept."""
    return [split_state({k: v for k, v in g.items() if k != "params"}, f"group{i}")[0]
            for i, g in enumerate(engine.optimizer.param_groups)]


def load_group_settings(engine, saved: list[dict]) -> None:
    groups = engine.optimizer.param_groups
    if len(saved) != len(groups) and len({json.dumps(h, sort_keys=True, default=repr) for h in saved}) == 1:
        saved = saved[:1] * len(groups)  # groups that differed only in their parameters (e.g. DeepSpeed's MoE split)
    if len(saved) != len(groups):
        raise ValueError(f"checkpoint optimizer has {len(saved)} param groups, the current one {len(groups)}")
    for group, hyper in zip(groups, saved):
        group.update(join_state(hyper, {}))
