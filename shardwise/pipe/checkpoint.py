"""Pipeline checkpoints in the ordinary format, with layer-indexed names.

A pipeline's parameters are named by global layer index (``"3.fc.weight"``), whatever the number
of stages, so the ordinary checkpoint (``shardwise/checkpoint``) only needs every stage to
contribute: ``model.safetensors`` holds the whole model (rank 0 merges the stages' state dicts),
and each stage's first data-parallel rank writes its fp32 master weights and optimizer state as
named fragments (every rank under ZeRO 1-3). Loading asks for the fragments of the layers this
rank holds now, so a checkpoint written at 2 stages loads at 1 or 4 stages, and into the same
layers as a plain ``nn.Sequential`` (``shardwise.pipe.module.build_sequential``), and back.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from shardwise import comm
from shardwise.checkpoint import engine_io
from shardwise.checkpoint import state as st
from shardwise.checkpoint import tensor_parallel as tpc
from shardwise.checkpoint.files import TMP_PREFIX, recover_interrupted
from shardwise.checkpoint.fragments import index_fragments, rank_fragment_files
from shardwise.checkpoint.manifest import open_checkpoint
from shardwise.checkpoint.writer import SavePlan


def _layer_order(key: str):
    head = key.split(".", 1)[0]
    return (0, int(head), key) if head.isdigit() else (1, 0, key)


def _fragment_files(engine, view, rank: int):
    """This rank's fragment files. A replicated strategy (ZeRO 0) keeps everything on every data-parallel
    rank of a stage: its first one writes the stage's share, under its own global rank's file names."""
    strategy = engine.strategy
    if not strategy.replicated:
        yield from rank_fragment_files(view, rank)
        return
    if engine.grid.get_data_parallel_rank() != 0:
        return
    for name, tensors, descs in rank_fragment_files(view, 0):
        new = name.replace("_rank0", f"_rank{rank}", 1)
        yield new, tensors, [{**d, "file": new} for d in descs]


def save_checkpoint(engine, save_dir, *, tag=None, client_state=None, save_latest=True,
                    exclude_frozen_parameters=False) -> bool:
    engine.wait_for_checkpoint()  # an asynchronous save of this engine still in flight
    # What checkpoint/ reads of an engine (a narrow view where the engine offers one).
    view = engine.training_state() if getattr(type(engine), "training_state", None) else engine
    save_dir = Path(save_dir)
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    engine_io._validate_tag(view, tag)
    rank, world = comm.get_rank(), comm.get_world_size()
    plan = SavePlan(tmp=save_dir / f"{TMP_PREFIX}{tag}", final=save_dir / tag, rank=rank, world=world,
                    save_latest=save_latest)
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        recover_interrupted(save_dir)
        if plan.tmp.exists():
            shutil.rmtree(plan.tmp)
        plan.tmp.mkdir()
    comm.barrier()

    descs = []
    for name, tensors, file_descs in _fragment_files(engine, view, rank):
        descs.extend(file_descs)
        plan.tensors[name] = tensors
    rng_meta, rng_tensors = st.rng_state()
    plan.tensors[f"rank{rank}.safetensors"] = rng_tensors
    plan.json_files[f"rank{rank}.json"] = {"rng": rng_meta}

    first_of_stage = engine.grid.get_data_parallel_rank() == 0
    module_sd = engine.strategy.module_state_dict(engine.module) \
        if (first_of_stage or engine.strategy.gathers_module_state) else None
    if first_of_stage:  # whole tensors (the tensor group of a first data rank is all first data ranks)
        module_sd = tpc.gather_state_dict(module_sd, tpc.view_of(view))
    frozen = [n for n, p in engine.module.named_parameters() if not p.requires_grad]
    tp_first = tpc.view_of(view).rank == 0
    mine = ({k: v.detach().cpu() for k, v in module_sd.items()}, frozen) if first_of_stage and tp_first else None
    gathered = engine_io._all_gather_object((descs, mine))  # small models: tensors travel through gloo
    if rank == 0:
        merged, all_frozen = {}, set()
        for _, part in gathered:
            if part is not None:
                merged.update(part[0])
                all_frozen.update(part[1])
        merged = dict(sorted(merged.items(), key=lambda kv: _layer_order(kv[0])))
        manifest = engine_io._manifest(view, plan, merged, client_state or {}, exclude_frozen_parameters)
        keys = list(merged)
        if exclude_frozen_parameters:
            keys = [k for k in keys if k not in all_frozen]
            plan.tensors["model.safetensors"] = {k: merged[k] for k in keys}
            manifest["tensors"]["model"] = engine_io._describe(plan.tensors["model.safetensors"], "model.safetensors")
        manifest["module_keys"] = keys
        manifest["aliases"] = {}
        manifest["frozen"] = sorted(all_frozen)
        manifest["topology"]["pipe_stages"] = engine.num_stages
        manifest["tensors"].update(index_fragments([d for part, _ in gathered for d in part]))
        manifest["tag"] = tag
        plan.manifest = manifest
    reports = engine_io._all_gather_object(plan.write_files())
    if rank == 0:
        plan.commit(reports)
    comm.barrier()
    return True


def check_stage_layers(engine, load_dir, tag) -> None:
    """Strict loading, judged against the layers this stage holds (the checkpoint has them all)."""
    ckpt = open_checkpoint(load_dir, tag)
    if ckpt is None:
        return
    saved = set(ckpt.manifest.get("module_keys", []))
    missing = sorted(k for k in engine.module.state_dict() if k not in saved)
    if missing:
        raise ValueError(f"checkpoint {ckpt.folder} lacks layers of pipeline stage {engine.stage_id}: "
                         f"{', '.join(missing)}; load_module_strict=False keeps their current values")
