"""``deepspeed.checkpoint.ds_to_universal``: the metadata step of DeepSpeed's ZeRO-1/2 universal-checkpoint
converter, ``_aggregate_autoep_zero12_metadata``. The converter itself (``main``) is not provided: shardwise
reads DeepSpeed's checkpoints and universal checkpoints with its own importer (docs/checkpoints.md)."""
from deepspeed.checkpoint import constants as _c
from deepspeed.checkpoint.constants import PARAM_SHAPES
from deepspeed.checkpoint.deepspeed_checkpoint import USE_DATA_BEFORE_EXPERT_PARALLELISM, DeepSpeedCheckpoint

__all__ = ["DeepSpeedCheckpoint"]


def _aggregate_autoep_zero12_metadata(model_state_metadata):
    """From ``DeepSpeedCheckpoint.model_state_metadata`` (one entry per model-state file): the per-file
    parameter-shape dictionaries, the AutoEP layer metadata merged over files by ``expert_key_prefix`` (None
    when no file has any), and the one ``use_data_before_expert_parallelism`` setting all files share.
    Malformed metadata, two files describing one expert prefix differently, or files disagreeing on the
    setting is a ``RuntimeError`` naming the file(s)."""
    shapes_per_file = []
    layers_by_prefix, source_by_prefix = {}, {}
    ordering_by_file = {}
    for model_file, metadata in model_state_metadata:
        shapes = metadata[PARAM_SHAPES]
        if not isinstance(shapes, dict):
            raise RuntimeError(f"DeepSpeed checkpoint {PARAM_SHAPES} must contain dictionaries in {model_file}.")
        shapes_per_file.append(shapes)

        layers = metadata[_c.AUTOEP_LAYERS_KEY]
        if layers is not None:
            if not isinstance(layers, list):
                raise RuntimeError(f"AutoEP metadata must be a list in {model_file}.")
            for layer in layers:
                if not isinstance(layer, dict):
                    raise RuntimeError(f"AutoEP layer metadata must contain dictionaries in {model_file}.")
                prefix = layer.get(_c.AUTOEP_EXPERT_KEY_PREFIX)
                if not isinstance(prefix, str) or not prefix:
                    raise RuntimeError(f"AutoEP expert_key_prefix must be a non-empty string in {model_file}.")
                if prefix not in layers_by_prefix:
                    layers_by_prefix[prefix], source_by_prefix[prefix] = layer, model_file
                elif layers_by_prefix[prefix] != layer:
                    raise RuntimeError(f"Conflicting AutoEP metadata for expert_key_prefix {prefix!r} in "
                                       f"{source_by_prefix[prefix]} and {model_file}.")

        ds_config = metadata["ds_config"]
        if not isinstance(ds_config, dict):
            raise RuntimeError(f"DeepSpeed checkpoint ds_config must be a dictionary in {model_file}.")
        ordering = ds_config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False)
        if not isinstance(ordering, bool):
            raise RuntimeError(f"DeepSpeed checkpoint {USE_DATA_BEFORE_EXPERT_PARALLELISM} must be a boolean in "
                               f"{model_file}.")
        ordering_by_file[model_file] = ordering

    if len(set(ordering_by_file.values())) != 1:
        raise RuntimeError(f"DeepSpeed checkpoint {USE_DATA_BEFORE_EXPERT_PARALLELISM} disagrees across model-state "
                           f"files: {ordering_by_file}")
    return shapes_per_file, list(layers_by_prefix.values()) or None, next(iter(ordering_by_file.values()))
