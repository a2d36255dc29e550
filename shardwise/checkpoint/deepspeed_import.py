"""``convert_deepspeed_checkpoint``: a DeepSpeed checkpoint folder as a native shardwise checkpoint, read by
``deepspeed_format._Reader`` (dense, pipeline, universal) or ``deepspeed_moe.MoEReader`` (MoE expert files)."""

from __future__ import annotations

import shutil
from pathlib import Path

from shardwise.checkpoint.deepspeed_format import DeepSpeedLayoutError, _Reader, find_deepspeed_folder
from shardwise.checkpoint.deepspeed_moe import MoEReader, is_moe_folder
from shardwise.checkpoint.files import TMP_PREFIX, write_tensors
from shardwise.checkpoint.writer import SavePlan


def convert_deepspeed_checkpoint(ds_dir, out_dir, *, tag=None, param_names: list[str] | None = None) -> Path:
    """Write the DeepSpeed checkpoint ``ds_dir`` (``tag`` or ``latest``) as a native shardwise
    checkpoint ``out_dir/<tag>`` (and ``out_dir/latest``); returns that folder.

    ``param_names``: the trainable parameters in order, only needed for a ZeRO-0 checkpoint whose
    optimizer holds fewer parameters than the module (DeepSpeed names none at stage 0)."""
    folder = find_deepspeed_folder(ds_dir, tag)
    if folder is None:
        raise FileNotFoundError(f"{ds_dir}: no DeepSpeed checkpoint there (no *model_states.pt"
                                f"{' in tag ' + str(tag) if tag is not None else ''}, and no 'latest')")
    tag_name = folder.name
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = SavePlan(tmp=out_dir / f"{TMP_PREFIX}{tag_name}", final=out_dir / tag_name, rank=0, world=1)
    if plan.tmp.exists():
        shutil.rmtree(plan.tmp)
    plan.tmp.mkdir()
    try:
        reader = (MoEReader if is_moe_folder(folder) else _Reader)(folder, param_names, plan.tmp)
        try:
            reader.read()
        except DeepSpeedLayoutError as e:
            raise DeepSpeedLayoutError(f"{e} [written by DeepSpeed {reader.ms.get('ds_version', '?')}]") from None
        plan.manifest = reader.manifest(tag_name)
        plan.written.update(reader.out.written)
        for name, tensors in {"model.safetensors": reader.canonical, "extra.safetensors": reader.extra}.items():
            plan.written[name] = (write_tensors(plan.tmp / name, tensors), 0)
    except BaseException:
        shutil.rmtree(plan.tmp, ignore_errors=True)
        raise
    plan.commit([plan.write_files()])
    return plan.final
