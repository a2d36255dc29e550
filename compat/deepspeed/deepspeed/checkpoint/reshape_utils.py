"""``deepspeed.checkpoint.reshape_utils``: finding a DeepSpeed checkpoint folder's files and merging the state
of several source ranks into one, as DeepSpeed's reshaping tools do.

Merging (``merge_state``): dictionaries merge key by key, lists and tuples element by element, tensors are
concatenated along dim 0, any other value is taken from the first state; two states of different types are a
``ValueError``."""
import os
import re
from collections import OrderedDict

import torch

from deepspeed.checkpoint.constants import BF16_ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, MODEL_FILE_PREFIX, ZERO_FILE_PREFIX

__all__ = ["basic_folder_validation", "get_files", "get_files_with_prefix", "get_zero_files", "merge_state",
           "merge_state_dict", "merge_state_list", "partition_data", "sort_zero_files", "validate_files"]


def basic_folder_validation(dir):
    assert os.path.exists(dir), f"{dir} path does not exist"
    assert os.path.isdir(dir), f"{dir} is not a folder"


def get_files_with_prefix(all_files, prefix):
    """The paths of ``all_files`` whose file name starts with ``prefix``, sorted."""
    return sorted(path for path in all_files if os.path.basename(path).startswith(prefix))


def validate_files(file_list):
    for path in file_list:
        if not os.path.isfile(path):
            print(f"Error: {path} is not existent")


def get_files(dir):
    """Every file under ``dir``, recursively."""
    return [os.path.join(root, name) for root, _, names in os.walk(dir) for name in names]


def sort_zero_files(files, prefix):
    """ZeRO optimizer files ordered by (data-parallel rank, model-parallel rank), both read from the name
    (``<prefix><dp>_mp_rank_<mp>``); a name that does not parse is a ``ValueError``."""
    pattern = re.compile(f"{prefix}([0-9]+)_{MODEL_FILE_PREFIX}([0-9]+)")
    keyed = []
    for path in files:
        match = pattern.search(path)
        if match is None:
            raise ValueError(f"Cannot parse dp_rank and mp_rank from {path}")
        keyed.append((int(match.group(1)), int(match.group(2)), path))
    return [path for _, _, path in sorted(keyed, key=lambda k: (k[0], k[1]))]


def get_zero_files(dir):
    """The ZeRO optimizer-state files of ``dir`` (the first of the plain, fp16 and bf16 name forms present),
    in (dp rank, mp rank) order."""
    all_files = get_files(dir)
    for prefix in (ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, BF16_ZERO_FILE_PREFIX):
        found = get_files_with_prefix(all_files, prefix)
        if found:
            return sort_zero_files(found, prefix)
    return []


def partition_data(data_list, num_partitions):
    """``data_list`` cut into ``num_partitions`` consecutive equal pieces (the length must divide)."""
    assert len(data_list) % num_partitions == 0
    size = len(data_list) // num_partitions
    return [data_list[start:start + size] for start in range(0, len(data_list), size)]


def merge_state_dict(dict_a, dict_b, key_list):
    merged = type(dict_a)({})
    for key, value in dict_b.items():
        merged[key] = merge_state(dict_a[key], value, [str(key)]) if key in dict_a else value
    return merged


def merge_state_list(list_a, list_b, key_list):
    if len(list_a) != len(list_b):
        print(".".join(key_list))
        raise ValueError(f"Cannot merge lists of different lengths, a = {len(list_a)} b = {len(list_b)}")
    return [merge_state(a, b, key_list) for a, b in zip(list_a, list_b)]


def merge_state(state_a, state_b, key_list=[]):  # noqa: B006 (DeepSpeed's signature)
    if type(state_a) is not type(state_b):
        print(f"key_list = {'.'.join(key_list)}")
        raise ValueError(f"Cannot merge two states of types {type(state_a)} and type {type(state_b)}")
    if type(state_a) in (dict, OrderedDict):
        return merge_state_dict(state_a, state_b, key_list)
    if type(state_a) in (list, tuple):
        return type(state_a)(merge_state_list(state_a, state_b, key_list))
    if torch.is_tensor(state_a):
        return torch.cat([state_a, state_b], 0)
    return state_a
