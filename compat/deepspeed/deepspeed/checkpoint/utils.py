"""``deepspeed.checkpoint.utils``: the helper accelerate calls before ``torch.save`` of a state dict
(``clone_tensors_for_torch_save``) and DeepSpeed's checkpoint file names for a rank."""
import os

import torch

from .constants import MODEL_FILE_PREFIX, MODEL_FILE_SUFFIX, OPTIM_FILE_SUFFIX, ZERO_FILE_PREFIX


def get_model_ckpt_name_for_rank(base_folder, mp_rank_str):
    """``<base_folder>/mp_rank_<mp_rank_str>_model_states.pt``: the model file of tensor rank ``mp_rank_str``
    ("00", ...) in a DeepSpeed-layout tag folder (what ``save_checkpoint`` writes beside its own files)."""
    return os.path.join(base_folder, f"{MODEL_FILE_PREFIX}{mp_rank_str}{MODEL_FILE_SUFFIX}")


def get_zero_ckpt_name_for_rank(base_folder, dp_rank, mp_rank):
    """``<base_folder>/zero_pp_rank_<dp>_mp_rank_<mp:02d>_optim_states.pt``: a ZeRO optimizer-state file."""
    return os.path.join(base_folder, f"{ZERO_FILE_PREFIX}{dp_rank}_{MODEL_FILE_PREFIX}{mp_rank:02d}{OPTIM_FILE_SUFFIX}")


def get_layer_ckpt_name_for_rank(base_folder, layer_id, tp_rank):
    """``<base_folder>/<layer_id>-model_<tp:02d>_model_states.pt``: a pipeline layer's file."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}{MODEL_FILE_SUFFIX}")


def clone_tensors_for_torch_save(item, device: torch.device = torch.device("cpu")):
    """A copy of ``item`` (tensors, or lists/tuples/dicts of them) whose tensors are cloned to ``device``,
    so a saved tensor holds only its own elements, not the whole storage a view points into."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
