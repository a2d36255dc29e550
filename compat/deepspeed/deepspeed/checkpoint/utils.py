"""``deepspeed.checkpoint.utils``: the helper accelerate calls before ``torch.save`` of a state dict
(shardwise's ``clone_tensors_for_torch_save``) and DeepSpeed's checkpoint file names for a rank."""
import os

from shardwise.checkpoint.utils import clone_tensors_for_torch_save  # noqa: F401

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
