"""``engine.save_checkpoint`` / ``engine.load_checkpoint``.

Layout of one checkpoint (``<save_dir>/<tag>/``)::

    manifest.json          what is where: tensors by name with their fragments, file checksums,
                           engine counters, optimizer hyper-parameters, scheduler, loss scaler,
                           client_state, config, topology, library version
    model.safetensors      the module's state_dict (16-bit weights when training in fp16/bf16)
    master_rank<r>.safetensors  fp32 master weights (16-bit training) this rank owns, as fragments
    optim_rank<r>.safetensors   optimizer state this rank owns, keyed "<name>@<start>:<end>/<state>"
    extra.safetensors      tensors inside scheduler / client_state
    rank<r>.safetensors    per-rank RNG state (torch, numpy) and rank<r>.json (python RNG)

The folder is written as ``.tmp.<tag>``, fsynced, then renamed; ``latest``
is replaced only after that.  Every tensor is described by
``{file, key, start, end}`` fragments of its flattened data, so stages that
shard state (written by several ranks) use the same manifest.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from shardwise import __version__, comm
from shardwise.checkpoint.files import (
    publish_dir,
    read_tensors,
    replace_text_atomically,
    write_json,
    write_tensors,
)
from shardwise.checkpoint.fragments import FragmentReader, index_fragments, load_fragments, write_rank_fragments
from shardwise.checkpoint.serialize import join_state, split_state

logger = logging.getLogger("shardwise")

FORMAT = "shardwise-checkpoint"
VERSION = 1


def _describe(tensors: dict[str, torch.Tensor], file: str) -> dict:
    return {
        k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch."),
            "fragments": [{"file": file, "key": k, "start": 0, "end": v.numel()}]}
        for k, v in tensors.items()
    }


def _optimizer_groups(engine) -> list[dict]:
    """Hyper-parameters of each param group (lr, betas, ...); which tensors belong to a group is
    decided by the strategy that loads, so only the settings are kept."""
    return [split_state({k: v for k, v in g.items() if k != "params"}, f"group{i}")[0]
            for i, g in enumerate(engine.optimizer.param_groups)]


def _rng_state() -> tuple[dict, dict[str, torch.Tensor]]:
    np_state = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(np_state[1].astype(np.int64))}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state()
    meta = {"python": split_state(random.getstate(), "python")[0],
            "numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])]}
    return meta, tensors


def _set_rng_state(meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    random.setstate(join_state(meta["python"], {}))
    name, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])


def save_checkpoint(engine, save_dir, *, tag=None, client_state=None, save_latest=True,
                    exclude_frozen_parameters=False) -> bool:
    save_dir = Path(save_dir)
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    _validate_tag(engine, tag)
    rank = comm.get_rank()
    tmp = save_dir / f".tmp.{tag}"
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # debris of an interrupted save
        tmp.mkdir()
    comm.barrier()

    rng_meta, rng_tensors = _rng_state()
    files, descs = write_rank_fragments(engine, tmp, rank)
    files[f"rank{rank}.safetensors"] = write_tensors(tmp / f"rank{rank}.safetensors", rng_tensors)
    files[f"rank{rank}.json"] = write_json(tmp / f"rank{rank}.json", {"rng": rng_meta})
    all_files, all_descs = {}, []
    for part_files, part_descs in _all_gather_object((files, descs)):
        all_files.update(part_files)
        all_descs.extend(part_descs)

    # Stage 3 assembles the full weights collectively; other stages read them on rank 0 alone.
    module_sd = engine.strategy.module_state_dict(engine.module) \
        if (rank == 0 or engine.strategy.gathers_module_state) else None
    if rank == 0:
        manifest = _write_shared(engine, tmp, all_files, module_sd, client_state or {}, exclude_frozen_parameters)
        manifest["tensors"].update(index_fragments(all_descs))
        manifest["tag"] = tag
        write_json(tmp / "manifest.json", manifest)
        publish_dir(tmp, save_dir / tag)
        if save_latest:
            replace_text_atomically(save_dir / "latest", tag)
    comm.barrier()
    return True


def _write_shared(engine, tmp: Path, files: dict, module_sd: dict, client_state: dict, exclude_frozen: bool) -> dict:
    if exclude_frozen:
        frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
        module_sd = {k: v for k, v in module_sd.items() if k not in frozen}
    tensors = {"model": _describe(module_sd, "model.safetensors")}
    files["model.safetensors"] = write_tensors(tmp / "model.safetensors", module_sd)
    optim_meta = {"param_groups": _optimizer_groups(engine)} if engine.optimizer is not None else None
    sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    sched_json, sched_tensors = split_state(sched, "scheduler")
    client_json, client_tensors = split_state(client_state, "client")
    extra = {**sched_tensors, **client_tensors}
    files["extra.safetensors"] = write_tensors(tmp / "extra.safetensors", extra)
    return {
        "format": FORMAT,
        "version": VERSION,
        "shardwise_version": __version__,
        "files": files,
        "tensors": tensors,
        "topology": {"world_size": comm.get_world_size(), "dp_world_size": engine.dp_world_size,
                     "zero_stage": engine.strategy.stage},
        "engine": {
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps,
            "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
            "param_dtype": str(engine.precision.param_dtype).removeprefix("torch."),
        },
        "optimizer": optim_meta,
        "lr_scheduler": sched_json,
        "client_state": client_json,
        "config": engine.config.to_dict(),
    }


def _all_gather_object(obj) -> list:
    if comm.get_world_size() == 1:
        return [obj]
    out = [None] * comm.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def _validate_tag(engine, tag: str) -> None:
    mode = str(engine.config.checkpoint.tag_validation).lower()
    if mode == "ignore" or comm.get_world_size() == 1:
        return
    tags = set(_all_gather_object(tag))
    if len(tags) > 1:
        msg = f"save_checkpoint: ranks were given different tags {sorted(tags)}"
        if mode == "fail":
            raise ValueError(msg + " (checkpoint.tag_validation is 'Fail')")
        logger.warning(msg)


def resolve_tag(load_dir: Path, tag) -> str | None:
    if tag is not None:
        tag = str(tag)
    else:
        latest = load_dir / "latest"
        if not latest.exists():
            return None
        tag = latest.read_text().strip()
    if not (load_dir / tag / "manifest.json").exists():
        existing = sorted(p.name for p in load_dir.iterdir() if (p / "manifest.json").exists()) if load_dir.exists() else []
        raise FileNotFoundError(
            f"no checkpoint '{tag}' in {load_dir}; tags there: {', '.join(existing) or 'none'}"
        )
    return tag


def load_checkpoint(engine, load_dir, *, tag=None, load_module_strict=True, load_optimizer_states=True,
                    load_lr_scheduler_states=True, load_module_only=False):
    load_dir = Path(load_dir)
    tag = resolve_tag(load_dir, tag)
    if tag is None:
        logger.warning("load_checkpoint: no 'latest' file in %s and no tag given; nothing loaded", load_dir)
        return None, None
    ckpt = load_dir / tag
    manifest = json.loads((ckpt / "manifest.json").read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{ckpt / 'manifest.json'} is not a shardwise checkpoint manifest")
    files = manifest["files"]

    def read(name: str) -> dict[str, torch.Tensor]:
        return read_tensors(ckpt / name, files.get(name))

    model_state = read("model.safetensors")
    _load_module(engine, model_state, strict=load_module_strict, where=ckpt / "model.safetensors")
    load_opt = load_optimizer_states and not load_module_only and bool(manifest.get("optimizer"))
    if load_opt:
        engine.optimizer.state.clear()
    load_fragments(engine, FragmentReader(ckpt, files), manifest, model_state, load_optimizer=load_opt)

    client_state = {}
    if not load_module_only:
        if load_opt:
            _load_group_settings(engine, manifest["optimizer"]["param_groups"])
        extra = read("extra.safetensors")
        if load_lr_scheduler_states and engine.lr_scheduler is not None and manifest["lr_scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(join_state(manifest["lr_scheduler"], extra))
        state = manifest["engine"]
        engine.global_steps = state["global_steps"]
        engine.global_samples = state["global_samples"]
        engine.micro_steps = state["micro_steps"]
        engine.skipped_steps = state["skipped_steps"]
        if engine.loss_scaler is not None and state["loss_scaler"] is not None:
            engine.loss_scaler.load_state_dict(state["loss_scaler"])
        client_state = join_state(manifest["client_state"], extra)
        rank = comm.get_rank()
        if manifest["topology"]["world_size"] == comm.get_world_size() and (ckpt / f"rank{rank}.json").exists():
            meta = json.loads((ckpt / f"rank{rank}.json").read_text())
            _set_rng_state(meta["rng"], read(f"rank{rank}.safetensors"))
    comm.barrier()
    return str(ckpt), client_state


def _load_module(engine, state: dict[str, torch.Tensor], *, strict: bool, where: Path) -> None:
    own = {k: tuple(v._sw.shape if hasattr(v, "_sw") else v.shape)
           for k, v in engine.module.state_dict(keep_vars=True).items()}
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    mismatched = sorted(f"{k}: checkpoint {tuple(state[k].shape)} vs model {own[k]}"
                        for k in set(own) & set(state) if own[k] != tuple(state[k].shape))
    if mismatched or (strict and (missing or unexpected)):
        parts = []
        if missing:
            parts.append("missing in checkpoint: " + ", ".join(missing))
        if unexpected:
            parts.append("not in model: " + ", ".join(unexpected))
        if mismatched:
            parts.append("shape mismatch: " + "; ".join(mismatched))
        raise ValueError(f"checkpoint {where} does not match the model ({' | '.join(parts)}); "
                         "load_module_strict=False ignores missing/unexpected names")
    engine.strategy.load_module_state_dict(engine.module, state)


def _load_group_settings(engine, saved: list[dict]) -> None:
    groups = engine.optimizer.param_groups
    if len(saved) != len(groups):
        raise ValueError(f"checkpoint optimizer has {len(saved)} param groups, the current one {len(groups)}")
    for group, hyper in zip(groups, saved):
        group.update(join_state(hyper, {}))
