"""``engine.load_checkpoint``: which format a folder holds, and one agreed outcome on every rank.

The two readers sit below this module and do not know of each other: ``engine_io.read_checkpoint``
reads a native checkpoint; ``deepspeed_import.convert_deepspeed_checkpoint`` turns DeepSpeed's own
layout into a native one (in a temporary folder, on each rank) for it to read.

Reading runs no collective. Every rank reads its part to the end (or to its error), then the ranks
gather their outcomes (``agreement.py``): a damaged file of one rank is named, with its path, on
every rank, instead of the others waiting for that rank in a barrier.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from shardwise.checkpoint.agreement import agree_on_load
from shardwise.checkpoint.deepspeed_format import find_deepspeed_folder, pipeline_module_keys
from shardwise.checkpoint.deepspeed_import import convert_deepspeed_checkpoint
from shardwise.checkpoint.engine_io import read_checkpoint, wait_for_save
from shardwise.checkpoint.manifest import list_tags, open_checkpoint
from shardwise.checkpoint.writer import CheckpointWriter

logger = logging.getLogger("shardwise")


def load_checkpoint(engine, load_dir, *, writer: CheckpointWriter, tag=None, **options):
    """Load into the parts of ``engine`` (a ``TrainingState``); ``options`` are ``engine.load_checkpoint``'s
    (``load_module_strict``, ``load_optimizer_states``, ...). Returns ``(folder, client_state, counters)``,
    ``(None, None, None)`` when there is nothing to load. Collective: call it on every rank."""
    wait_for_save(writer)
    result, error = (None, None, None), None
    try:
        result = _read(engine, load_dir, tag, options)
    except Exception as e:  # agreed below: every rank names it
        error = e
    agree_on_load(error, f"loading the checkpoint in {load_dir}")
    return result


def _read(engine, load_dir, tag, options):
    ds_folder = find_deepspeed_folder(load_dir, tag)
    if ds_folder is not None:  # DeepSpeed's own layout
        names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
        with tempfile.TemporaryDirectory(prefix="shardwise-from-deepspeed-") as tmp:
            converted = convert_deepspeed_checkpoint(load_dir, tmp, tag=tag, param_names=names)
            _, client_state, counters = read_checkpoint(engine, open_checkpoint(converted), **options)
        logger.info("loaded DeepSpeed checkpoint %s", ds_folder)
        return str(ds_folder), client_state, counters
    ckpt = open_checkpoint(load_dir, tag)
    if ckpt is None:
        tags = list_tags(Path(load_dir))
        logger.warning("load_checkpoint: no 'latest' file in %s and no tag given; nothing loaded%s", load_dir,
                       f" (tags there: {', '.join(tags)})" if tags else "")
        return None, None, None
    return read_checkpoint(engine, ckpt, **options)


def check_stage_layers(engine, load_dir, tag, *, stage_id: int) -> None:
    """A pipeline stage's strict load, judged against the layers it holds (the checkpoint has every
    stage's). Collective: the ranks agree, so a stage missing layers is named on every rank."""
    error = None
    try:
        ds_folder = find_deepspeed_folder(load_dir, tag)
        if ds_folder is None:
            ckpt = open_checkpoint(load_dir, tag)
            folder = ckpt.folder if ckpt is not None else None
            saved = set(ckpt.manifest.get("module_keys", [])) if ckpt is not None else None
        else:  # DeepSpeed's: its pipeline layer files name the layers (a data-parallel one: judged on loading)
            folder, saved = ds_folder, pipeline_module_keys(ds_folder)
        missing = sorted(k for k in engine.module.state_dict() if saved is not None and k not in saved)
        hint = ""
        if missing and ds_folder is not None:
            files = sorted({f"layer_{int(k.split('.')[0]):02d}-model_states.pt" for k in missing
                            if k.split(".")[0].isdigit()})
            hint = f" (DeepSpeed's layer files {', '.join(files)} are missing or lack them)" if files else ""
        if missing:
            raise ValueError(f"checkpoint {folder} lacks layers of pipeline stage {stage_id}: "
                             f"{', '.join(missing)}{hint}; load_module_strict=False keeps their current values")
    except Exception as e:
        error = e
    agree_on_load(error, f"loading the checkpoint in {load_dir}")
