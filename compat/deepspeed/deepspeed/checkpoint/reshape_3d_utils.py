"""``deepspeed.checkpoint.reshape_3d_utils``: a checkpoint's (pipeline, tensor, data) degrees and the map from
a smaller target layout to the source files each target rank merges.

The degrees come from the ``checkpoint_parallel_dimensions`` entry DeepSpeed writes into every model-state
file (all files must carry it and agree, and the file counts must fit it); a checkpoint written before that
entry existed is read from its file counts: the tensor degree is the number of ``layer_01*`` files (pipeline
checkpoints) or of model-state files, and the data degree is the ZeRO file count over the model-parallel
size. A model-state file is loaded once and only this entry kept."""
import torch

from deepspeed.checkpoint.constants import (CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE,
                                            LAYER_FILE_PREFIX, MODEL_FILE_PREFIX)
from deepspeed.checkpoint.reshape_meg_2d import meg_2d_parallel_map, reshape_meg_2d_parallel
from deepspeed.checkpoint.reshape_utils import get_files, get_files_with_prefix, get_zero_files, partition_data

__all__ = ["DP_DIM", "PP_DIM", "TP_DIM", "flatten_dp_dimension", "get_model_3d_descriptor",
           "get_model_3d_descriptor_from_metadata", "model_3d_desc", "unflatten_dp_dimension"]

PP_DIM = "PP"
TP_DIM = "TP"
DP_DIM = "DP"


class model_3d_desc:  # noqa: N801 (DeepSpeed's name)
    """A (pipeline, tensor, data) layout."""

    def __init__(self, pp_degree=1, tp_degree=1, dp_degree=1):
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.dp_degree = dp_degree

    def reshape(self, target_3d_desc, verbose=False):
        """One ``meg_2d_parallel_map`` per target data rank: the source ranks (ZeRO file indices, data-major)
        each target (stage, tensor rank) merges. Only contraction is possible (AssertionError otherwise)."""
        ok, errors = self.can_reshape(target_3d_desc)
        assert ok, ",".join(errors)
        map_2d = reshape_meg_2d_parallel(old_pp_degree=self.pp_degree, old_tp_degree=self.tp_degree,
                                         new_pp_degree=target_3d_desc.pp_degree,
                                         new_tp_degree=target_3d_desc.tp_degree, verbose=verbose)
        flat = flatten_dp_dimension(meg_2d_map=map_2d, src_2d_size=self.pp_degree * self.tp_degree,
                                    dp_degree=self.dp_degree)
        return unflatten_dp_dimension(meg_2d_map=flat, dp_degree=target_3d_desc.dp_degree)

    def get_desc(self):
        return f"{PP_DIM},{TP_DIM},{DP_DIM} = ({self.pp_degree}, {self.tp_degree}, {self.dp_degree})"

    def world_size(self):
        return self.pp_degree * self.tp_degree * self.dp_degree

    def is_valid(self, pp_index, tp_index, dp_index):
        errors = [f"{dim} indexing error: index {index} >= degree {degree}"
                  for index, degree, dim in ((pp_index, self.pp_degree, PP_DIM), (tp_index, self.tp_degree, TP_DIM),
                                             (dp_index, self.dp_degree, DP_DIM)) if index >= degree]
        return not errors, errors

    def can_reshape(self, target_3d_desc):
        errors = [f"Expansion reshape not supported - {dim}: {old} ---> {new}"
                  for dim, old, new in ((PP_DIM, self.pp_degree, target_3d_desc.pp_degree),
                                        (TP_DIM, self.tp_degree, target_3d_desc.tp_degree),
                                        (DP_DIM, self.dp_degree, target_3d_desc.dp_degree)) if new > old]
        return not errors, errors


def _positive_degree(dimensions, key, model_file):
    value = dimensions.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RuntimeError(f"Checkpoint {key} must be a positive integer in {model_file}, got {value!r}.")
    return value


def get_model_3d_descriptor_from_metadata(file_list, zero_file_list, model_state_metadata):
    """The layout of a checkpoint from its file lists and ``[(model_file, {checkpoint_parallel_dimensions:
    ...}), ...]`` (no checkpoint is loaded). A recorded layout that is missing from some files, disagrees
    between files, or does not fit the file counts is a ``RuntimeError`` naming the files."""
    model_files = [model_file for model_file, _ in model_state_metadata]
    recorded, missing = [], []
    for model_file, metadata in model_state_metadata:
        dimensions = metadata.get(CHECKPOINT_PARALLEL_DIMS)
        if dimensions is None:
            missing.append(model_file)
            continue
        if not isinstance(dimensions, dict):
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} must be a dictionary in {model_file}.")
        recorded.append((_positive_degree(dimensions, CHECKPOINT_PP_DEGREE, model_file),
                         _positive_degree(dimensions, CHECKPOINT_TP_DEGREE, model_file)))

    if recorded:
        if missing:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} is missing from model-state files: {missing}")
        if len(set(recorded)) != 1:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} disagrees across model-state files: "
                               f"{recorded}")
        pp_degree, tp_degree = recorded[0]
        if len(model_files) != pp_degree * tp_degree:
            raise RuntimeError(f"Checkpoint model-state file count {len(model_files)} does not match "
                               f"{CHECKPOINT_PP_DEGREE}={pp_degree} * {CHECKPOINT_TP_DEGREE}={tp_degree}.")
        if len(zero_file_list) % (pp_degree * tp_degree):
            raise RuntimeError(f"Checkpoint ZeRO file count {len(zero_file_list)} is not divisible by "
                               f"{CHECKPOINT_PP_DEGREE}={pp_degree} * {CHECKPOINT_TP_DEGREE}={tp_degree}.")
        return model_3d_desc(pp_degree, tp_degree, max(1, len(zero_file_list) // (pp_degree * tp_degree)))

    # written before the layout was recorded: read it from the file counts
    first_layer_files = len(get_files_with_prefix(file_list, f"{LAYER_FILE_PREFIX}01"))
    if first_layer_files:
        tp_degree = first_layer_files
        pp_degree = len(model_files) // tp_degree
    else:
        tp_degree, pp_degree = len(model_files), 1
    return model_3d_desc(pp_degree, tp_degree, max(1, len(zero_file_list) // (pp_degree * tp_degree)))


def get_model_3d_descriptor(dir):
    """The layout of the checkpoint folder ``dir`` (see the module's docstring)."""
    file_list = get_files(dir)
    metadata = []
    for model_file in get_files_with_prefix(file_list, MODEL_FILE_PREFIX):
        state = torch.load(model_file, map_location="cpu", weights_only=False)
        metadata.append((model_file, {CHECKPOINT_PARALLEL_DIMS: state.get(CHECKPOINT_PARALLEL_DIMS)}))
        del state
    return get_model_3d_descriptor_from_metadata(file_list, get_zero_files(dir), metadata)


def flatten_dp_dimension(meg_2d_map, src_2d_size, dp_degree):
    """Extend each entry's model-parallel indices with their copies on every data rank (index + d * size)."""
    flat = meg_2d_parallel_map(meg_2d_map.pp_degree, meg_2d_map.tp_degree)
    for stage in range(meg_2d_map.pp_degree):
        for rank in range(meg_2d_map.tp_degree):
            for idx in meg_2d_map.get_data(stage, rank):
                flat.add_data(stage, rank, [idx + d * src_2d_size for d in range(dp_degree)])
    return flat


def unflatten_dp_dimension(meg_2d_map, dp_degree):
    """Split each entry's indices into ``dp_degree`` consecutive pieces, one map per target data rank."""
    maps = [meg_2d_parallel_map(pp_degree=meg_2d_map.pp_degree, tp_degree=meg_2d_map.tp_degree)
            for _ in range(dp_degree)]
    for stage in range(meg_2d_map.pp_degree):
        for rank in range(meg_2d_map.tp_degree):
            for piece, target in zip(partition_data(meg_2d_map.get_data(stage, rank), dp_degree), maps):
                target.add_data(stage, rank, piece)
    return maps
