"""The native format: ``engine.save_checkpoint`` (every layout: ``module_weights.py`` says where the
module weights come from) and reading one native checkpoint (``loading.py`` tells the formats apart).

Layout of one checkpoint (``<save_dir>/<tag>/``)::

    manifest.json          what is where: tensors by name with their fragments, file checksums and
                           sizes, engine counters, data position, optimizer hyper-parameters,
                           scheduler, loss scaler, client_state, config, topology, library version
    model.safetensors      the module's state_dict, whole tensors (16-bit weights when training in fp16/bf16;
                           a pipeline's layers of every stage, named by global layer index)
    master_rank<r>.safetensors  fp32 master weights (16-bit training) this rank owns, as fragments
    optim_rank<r>.safetensors   optimizer state this rank owns, keyed "<name>@<start>:<end>/<state>"
    extra.safetensors      tensors inside scheduler / client_state
    rank<r>.safetensors    per-rank RNG state (torch, numpy) and rank<r>.json (python RNG)

The folder is written as ``.tmp.<tag>``, fsynced, then renamed; ``latest`` is replaced only after
that (``files.py``, ``writer.py``).  Every tensor is described by ``{file, key, start, end}``
fragments of its flattened data, so a checkpoint loads at any world size and ZeRO stage.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from shardwise import comm
from shardwise.version import __version__
from shardwise.checkpoint import state as st
from shardwise.checkpoint import tensor_parallel as tpc
from shardwise.checkpoint.agreement import agree, gather_object
from shardwise.checkpoint.files import TMP_PREFIX
from shardwise.checkpoint.fragments import FragmentReader, index_fragments, load_fragments, rank_fragment_files
from shardwise.checkpoint.manifest import FORMAT, VERSION, Checkpoint
from shardwise.checkpoint.module_weights import ModuleWeights, WeightsSource, collect_module_weights, default_source
from shardwise.checkpoint.serialize import join_state, split_state
from shardwise.checkpoint.writer import CheckpointWriter, SavePlan, raise_if_failed, snapshot, try_prepare
from shardwise.training_state import StepCounters
from shardwise.zero.partitioned_param import full_shape

logger = logging.getLogger("shardwise")


def _describe(tensors: dict[str, torch.Tensor], file: str) -> dict:
    return {
        k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch."),
            "fragments": [{"file": file, "key": k, "start": 0, "end": v.numel()}]}
        for k, v in tensors.items()
    }


def wait_for_save(writer: CheckpointWriter) -> None:
    """Every rank: wait until the asynchronous save in flight (if any) is committed. Collective
    when a save was in flight (one was on every rank then, saves being collective): the ranks agree
    on its outcome, so a rank whose part failed is named on every rank (a failing rank raises its own)."""
    error = None
    try:
        in_flight = writer.wait()
    except RuntimeError as e:  # this rank's writing (on rank 0: the commit) failed
        in_flight, error = True, e
    if in_flight:  # once agreed, rank 0 has committed: 'latest' names the new tag for everyone
        agree(error, lambda failures: raise_if_failed(failures, "the asynchronous save"))


def _is_async(engine) -> bool:
    w = getattr(engine.config.checkpoint, "writer", None)
    return bool(w is not None and w.decoupled)


def save_checkpoint(engine, save_dir, *, writer: CheckpointWriter, tag=None, client_state=None,
                    save_latest=True, exclude_frozen_parameters=False, weights: WeightsSource | None = None) -> bool:
    """``engine``: the engine's ``TrainingState`` (``shardwise/training_state.py``); ``writer``: its
    background writer (asynchronous saves); ``weights``: where the module weights come from
    (``module_weights.py``; default: this rank's module, gathered over tensor ranks when sharded).

    Every step that can fail on one rank (preparing the folder, writing, committing) ends in a gather
    of each rank's outcome, so a failure is a :class:`SaveFailed` naming it on every rank."""
    if not save_dir:
        raise ValueError(f"save_checkpoint: save_dir must name a folder, got {save_dir!r}")
    wait_for_save(writer)  # the previous asynchronous save, if any, is committed before this one starts
    started = time.perf_counter()
    save_dir = Path(save_dir)
    tag = str(tag) if tag is not None else f"global_step{engine.counters.global_steps}"
    _validate_tag(engine, tag)
    rank, world = comm.get_rank(), comm.get_world_size()
    asynchronous = _is_async(engine)
    plan = SavePlan(tmp=save_dir / f"{TMP_PREFIX}{tag}", final=save_dir / tag, rank=rank, world=world,
                    save_latest=save_latest, copied=asynchronous)
    # rank 0 clears debris of interrupted saves and makes .tmp.<tag>; every rank learns if it could not
    raise_if_failed(gather_object(try_prepare(save_dir, plan.tmp) if rank == 0 else None), f"saving {tag}")

    descs = []
    for name, tensors, file_descs in rank_fragment_files(engine, rank):
        descs.extend(file_descs)
        if asynchronous:
            plan.tensors[name] = snapshot(tensors)
        else:  # written now: with NVMe offload only this batch is resident
            plan.write_now(name, tensors)
    rng_meta, rng_tensors = st.rng_state()
    plan.tensors[f"rank{rank}.safetensors"] = rng_tensors
    plan.json_files[f"rank{rank}.json"] = {"rng": rng_meta, **_rank_settings(engine)}
    private = _rank_optimizer_state(engine)
    if private:  # per-rank optimizer state (1-bit optimizers' error feedback): one file per rank
        plan.tensors[f"optim_private_rank{rank}.safetensors"] = snapshot(private) if asynchronous else private
    all_descs = [d for part in gather_object(descs) for d in part]

    module = collect_module_weights(engine, weights or default_source(engine))  # rank 0: the whole module
    error = None
    if rank == 0:
        try:  # e.g. client_state holding what cannot be stored without pickle
            plan.manifest = _manifest(engine, plan, module, client_state or {}, exclude_frozen_parameters)
            plan.manifest["tensors"].update(index_fragments(all_descs))
            plan.manifest["tag"] = tag
        except Exception as e:
            error = e
    agree(error, lambda failures: raise_if_failed(failures, f"saving {tag}"))  # rank 0 raises its own
    if asynchronous:
        writer.start(plan)
        return True
    reports = gather_object(plan.try_write_files())
    raise_if_failed(reports, f"saving {tag}")  # e.g. a full disk on one rank: an error on every rank
    raise_if_failed(gather_object(plan.try_commit(reports) if rank == 0 else None), f"saving {tag}")
    _log_statistics(engine, plan, reports, started)
    return True


def _manifest(engine, plan: SavePlan, module: ModuleWeights, client_state: dict, exclude_frozen: bool) -> dict:
    """Rank 0: the shared files (module weights, scheduler/client tensors) and the manifest."""
    aliases, module_keys, frozen = module.aliases, module.keys, module.frozen
    module_sd = {k: v for k, v in module.state.items() if k not in aliases}
    if exclude_frozen:
        module_keys = [k for k in module_keys if aliases.get(k, k) not in frozen]
        module_sd = {k: v for k, v in module_sd.items() if k not in frozen}
        aliases = {k: v for k, v in aliases.items() if v not in frozen}
    copy = snapshot if plan.copied else (lambda d: d)
    plan.tensors["model.safetensors"] = copy(module_sd)
    optim_meta = {"param_groups": st.optimizer_groups(engine)} if engine.optimizer is not None else None
    sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    sched_json, sched_tensors = split_state(sched, "scheduler")
    client_json, client_tensors = split_state(client_state, "client")
    plan.tensors["extra.safetensors"] = copy({**sched_tensors, **client_tensors})
    return {
        "format": FORMAT,
        "version": VERSION,
        "shardwise_version": __version__,
        "tensors": {"model": _describe(module_sd, "model.safetensors")},
        "aliases": aliases,
        "module_keys": module_keys,
        "frozen": frozen,
        "topology": {"world_size": comm.get_world_size(), "dp_world_size": engine.dp_world_size,
                     "zero_stage": engine.strategy.stage,
                     **({"tensor_parallel_size": tpc.view_of(engine).size} if tpc.view_of(engine).active else {}),
                     **module.topology},
        "engine": {
            "global_steps": engine.counters.global_steps,
            "global_samples": engine.counters.global_samples,
            "micro_steps": engine.counters.micro_steps,
            "skipped_steps": engine.counters.skipped_steps,
            "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
            "param_dtype": str(engine.precision.param_dtype).removeprefix("torch."),
            "data": st.data_position(engine),
        },
        "optimizer": optim_meta,
        "lr_scheduler": sched_json,
        "client_state": client_json,
        "config": engine.config.to_dict(),
    }


def _log_statistics(engine, plan: SavePlan, reports: list[dict], started: float) -> None:
    w = getattr(engine.config.checkpoint, "writer", None)
    if w is None or not w.show_statistics or plan.rank != 0:
        return
    per_rank = [sum(size for _, size in r.values()) for r in reports]
    logger.info("checkpoint %s: %.3f s, bytes written per rank %s", plan.final, time.perf_counter() - started,
                per_rank)


class CheckpointTagMismatch(ValueError, AssertionError):
    """Ranks were given different checkpoint tags (tag_validation 'Fail'). A ValueError (a user mistake)
    that is also the AssertionError DeepSpeed raises here, so callers of either kind catch it."""


def _validate_tag(engine, tag: str) -> None:
    mode = str(engine.config.checkpoint.tag_validation).lower()
    if mode == "ignore" or comm.get_world_size() == 1:
        return
    tags = set(gather_object(tag))
    if len(tags) > 1:
        msg = f"save_checkpoint: ranks were given different tags {sorted(tags)}"
        if mode == "fail":
            raise CheckpointTagMismatch(msg + " (checkpoint.tag_validation is 'Fail')")
        logger.warning(msg)


def read_checkpoint(engine, ckpt: Checkpoint, *, load_module_strict=True, load_optimizer_states=True,
                    load_lr_scheduler_states=True, load_module_only=False):
    """Load the native checkpoint ``ckpt`` into the parts of ``engine`` (a ``TrainingState``). Returns
    ``(folder, client_state, counters)``; ``counters`` (``StepCounters``, None with ``load_module_only``)
    are for the engine to apply. Runs no collective: every rank reads what it needs and the caller
    (``loading.py``) agrees on the outcome."""
    manifest = ckpt.manifest
    model_state = ckpt.read("model.safetensors")
    for alias, name in manifest.get("aliases", {}).items():
        if name in model_state:
            model_state[alias] = model_state[name]
    model_state = tpc.shard_state_dict(model_state, tpc.view_of(engine))  # whole tensors -> this rank's pieces
    _load_module(engine, model_state, strict=load_module_strict, where=ckpt.path("model.safetensors"))
    load_opt = load_optimizer_states and not load_module_only and bool(manifest.get("optimizer"))
    if load_opt:
        if engine.optimizer is None:
            raise ValueError(f"checkpoint {ckpt.folder} holds optimizer state but the engine has no optimizer; "
                             "pass load_optimizer_states=False to load the weights only")
        engine.optimizer.state.clear()
    load_fragments(engine, FragmentReader(ckpt), manifest, model_state, load_optimizer=load_opt)
    if load_opt and hasattr(engine.optimizer, "load_rank_state_dict"):
        _load_rank_optimizer_state(engine, ckpt)

    client_state, counters = {}, None
    if not load_module_only:
        own = _own_rank_settings(ckpt)
        if load_opt:
            st.load_group_settings(engine, own.get("param_groups", manifest["optimizer"]["param_groups"]))
        extra = ckpt.read("extra.safetensors")
        sched = own.get("lr_scheduler", manifest["lr_scheduler"])
        if load_lr_scheduler_states and engine.lr_scheduler is not None and sched is not None:
            engine.lr_scheduler.load_state_dict(join_state(sched, extra))
        state = manifest["engine"]
        counters = StepCounters(global_steps=state["global_steps"], global_samples=state["global_samples"],
                                micro_steps=state["micro_steps"], skipped_steps=state["skipped_steps"])
        if engine.loss_scaler is not None and state["loss_scaler"] is not None:
            engine.loss_scaler.load_state_dict(state["loss_scaler"])
        st.restore_data_position(engine, state.get("data"))
        client_state = join_state(manifest["client_state"], extra)
        rank = comm.get_rank()
        # RNG streams belong to ranks: restored when the layout is the same, fresh otherwise.
        if manifest["topology"]["world_size"] == comm.get_world_size() and f"rank{rank}.json" in manifest["files"]:
            meta = json.loads(ckpt.check(f"rank{rank}.json").read_text())
            st.set_rng_state(meta["rng"], ckpt.read(f"rank{rank}.safetensors"))
    return str(ckpt.folder), client_state, counters


def _rank_settings(engine) -> dict:
    """This rank's optimizer group settings and scheduler state, kept beside its RNG state: the stages of a
    pipeline may hold different param groups (a stage with MoE layers has the experts' groups too), and the
    manifest's copy is rank 0's. (A scheduler state holding tensors stays rank 0's only.)"""
    out = {}
    if engine.optimizer is not None:
        out["param_groups"] = st.optimizer_groups(engine)
    if engine.lr_scheduler is not None:
        sched, tensors = split_state(engine.lr_scheduler.state_dict(), "scheduler")
        if not tensors:
            out["lr_scheduler"] = sched
    return out


def _own_rank_settings(ckpt) -> dict:
    """What ``_rank_settings`` saved for this rank, when the checkpoint has as many ranks as this run ({}
    otherwise, or for checkpoints saved before it was kept: the manifest's, rank 0's, are used)."""
    manifest, rank = ckpt.manifest, comm.get_rank()
    if manifest["topology"]["world_size"] != comm.get_world_size() or f"rank{rank}.json" not in manifest["files"]:
        return {}
    meta = json.loads(ckpt.check(f"rank{rank}.json").read_text())
    return {k: meta[k] for k in ("param_groups", "lr_scheduler") if k in meta}


def _rank_optimizer_state(engine) -> dict[str, torch.Tensor]:
    """Optimizer state that differs by rank and is not a fragment of a parameter (the 1-bit
    optimizers' error-feedback buffers): the optimizer's ``rank_state_dict()``, if it has one."""
    get = getattr(engine.optimizer, "rank_state_dict", None)
    return {k: v.detach() for k, v in get().items()} if get is not None else {}


def _load_rank_optimizer_state(engine, ckpt) -> None:
    """Give the optimizer this rank's own state back; refuse a different data-parallel size."""
    manifest = ckpt.manifest
    name = f"optim_private_rank{comm.get_rank()}.safetensors"
    if not any(f.startswith("optim_private_rank") for f in manifest["files"]):
        engine.optimizer.load_rank_state_dict(None)  # saved before there was any (warm-up): start afresh
        return
    topo = manifest["topology"]
    if topo["world_size"] != comm.get_world_size() or topo["dp_world_size"] != engine.dp_world_size:
        raise ValueError(
            f"checkpoint {ckpt.folder}: saved by {topo['world_size']} ranks ({topo['dp_world_size']} data-parallel) "
            f"with {type(engine.optimizer).__name__} past its warm-up; each rank's error-feedback buffers (and "
            "ZeroOneAdam's local momentum) belong to that rank and cannot be resharded to "
            f"{comm.get_world_size()} ranks ({engine.dp_world_size} data-parallel). Load it with "
            f"{topo['world_size']} ranks, or pass load_optimizer_states=False to load the weights only"
        )
    engine.optimizer.load_rank_state_dict(ckpt.read(name) if name in manifest["files"] else {})


def _load_module(engine, state: dict[str, torch.Tensor], *, strict: bool, where: Path) -> None:
    rename = getattr(engine.strategy, "saved_names", {})  # expert parallelism: experts by global index
    own = {rename.get(k, k): tuple(full_shape(v)) for k, v in engine.module.state_dict(keep_vars=True).items()}
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own) - getattr(engine.strategy, "held_elsewhere", set()))
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
    # A tied name is the same tensor as its canonical one: load that once (at stage 3 the alias is
    # not a parameter the strategy shards, so writing through it would hit released storage).
    aliases = st.tied_names(engine.module)
    engine.strategy.load_module_state_dict(engine.module,
                                           {k: v for k, v in state.items() if k in own and k not in aliases})
