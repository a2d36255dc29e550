"""``deepspeed.checkpoint.deepspeed_checkpoint``: ``DeepSpeedCheckpoint``, a DeepSpeed checkpoint folder read by
(pipeline, tensor, data) rank, optionally contracted to smaller degrees, as DeepSpeed's converters
(``ds_to_universal``, Megatron's ``deepspeed_to_megatron``) read it.

Each model-state file (``mp_rank_XX_model_states.pt``) is loaded once, when the folder is opened; only what
the layout and the converters need is kept (``model_state_metadata``: per file, its recorded parallel
dimensions, its parameter shapes flattened over groups, a light copy of its AutoEP layer metadata and of
its ``use_data_before_expert_parallelism`` setting; a value of the wrong type is kept as its type name so
the consumer can report it), plus the first file's ``iteration``, ``args``, ``checkpoint_info`` and
``universal_checkpoint_info``. Pipeline checkpoints' ``layer_NN-model_XX`` files are grouped per layer."""
import os
import re
from typing import Dict

import torch

from deepspeed.checkpoint import constants as _c
from deepspeed.checkpoint.constants import (CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE,
                                            LAYER_FILE_PREFIX, MODEL_FILE_PREFIX, PARAM_SHAPES,
                                            UNIVERSAL_CHECKPOINT_INFO)
from deepspeed.checkpoint.reshape_3d_utils import get_model_3d_descriptor_from_metadata, model_3d_desc
from deepspeed.checkpoint.reshape_meg_2d import meg_2d_parallel_map, reshape_meg_2d_parallel
from deepspeed.checkpoint.reshape_utils import (basic_folder_validation, get_files, get_files_with_prefix,
                                                get_zero_files, merge_state, partition_data)
from deepspeed.checkpoint.zero_checkpoint import ZeROCheckpoint

__all__ = ["ARGS_KEY", "AUTOEP_METADATA_FIELDS", "CHECKPOINT_INFO_KEY", "DeepSpeedCheckpoint", "EMBEDDING_LAYER_INDEX",
           "FINAL_LAYER_NORM_INDEX", "ITERATION_KEY", "LAYER_CONCAT_DIM", "LAYER_FILE_PREFIX_PATTERN",
           "SEQUENTIAL_LAYERS", "USE_DATA_BEFORE_EXPERT_PARALLELISM"]

EMBEDDING_LAYER_INDEX = 0
FINAL_LAYER_NORM_INDEX = -1
ARGS_KEY = "args"
CHECKPOINT_INFO_KEY = "checkpoint_info"
ITERATION_KEY = "iteration"
LAYER_FILE_PREFIX_PATTERN = r"layer_(\d+)-model_.*"
USE_DATA_BEFORE_EXPERT_PARALLELISM = "use_data_before_expert_parallelism"
AUTOEP_METADATA_FIELDS = ("moe_layer_id", "module_path") + tuple(_c.AUTOEP_ZERO12_REQUIRED_FIELDS)

# Megatron layer parameters every tensor rank holds whole (taken from the first file, not concatenated)
SEQUENTIAL_LAYERS = [
    "input_layernorm.weight", "input_layernorm.bias", "self_attention.dense.bias", "post_attention_layernorm.weight",
    "post_attention_layernorm.bias", "mlp.dense_4h_to_h.bias", "position_embeddings.weight"
]
# row-parallel Megatron weights, concatenated along dim 1 (the others along dim 0)
LAYER_CONCAT_DIM = {"self_attention.dense.weight": 1, "mlp.dense_4h_to_h.weight": 1}


def _load(path):
    return torch.load(path, map_location=torch.device("cpu"), weights_only=False)


def _type_name_unless(value, ok):
    return value if value is None or ok(value) else type(value).__name__


class DeepSpeedCheckpoint:

    def __init__(self, dir, tp_degree=None, pp_degree=None, dp_degree=None,
                 final_layer_norm_idx=FINAL_LAYER_NORM_INDEX):
        self.final_layer_norm_idx = final_layer_norm_idx
        self.dir = dir
        self.file_list = get_files(dir)
        self.layer_files = sorted(p for p in self.file_list
                                  if re.fullmatch(LAYER_FILE_PREFIX_PATTERN, os.path.basename(p)))
        self._validate_folder(dir, bool(self.layer_files))

        self.mp_rank_files = get_files_with_prefix(self.file_list, MODEL_FILE_PREFIX)
        self.model_state_metadata, self.global_state = self._discover_model_state_metadata()
        source_3d = get_model_3d_descriptor_from_metadata(self.file_list, get_zero_files(dir),
                                                          self.model_state_metadata)
        self.zero_checkpoint = ZeROCheckpoint(dir, source_3d=source_3d)

        self.layer_keys = self._get_layer_keys()
        self.layer_count = len(self.layer_keys)
        zc = self.zero_checkpoint
        self.tp_degree = zc.get_src_tp_degree() if tp_degree is None else tp_degree
        self.pp_degree = zc.get_src_pp_degree() if pp_degree is None else pp_degree
        self.dp_degree = zc.get_src_dp_degree() if dp_degree is None else dp_degree
        self.original_world_size = zc.get_src_world_size()
        self.world_size = self.tp_degree * self.pp_degree * self.dp_degree

        self.old_2d_map = meg_2d_parallel_map(zc.get_src_pp_degree(), zc.get_src_tp_degree())
        self.old_2d_map.simple_init()
        self.new_2d_map = reshape_meg_2d_parallel(old_pp_degree=zc.get_src_pp_degree(),
                                                  old_tp_degree=zc.get_src_tp_degree(),
                                                  new_pp_degree=self.pp_degree, new_tp_degree=self.tp_degree)
        if self.is_change_pp_degree() or self.is_change_tp_degree() or self.is_change_dp_degree():
            zc.reshape(model_3d_desc(self.pp_degree, self.tp_degree, self.dp_degree))

        self._sanity_check()
        self.pp_to_transformer_map = self._build_pp_transformer_map()
        self.transformer_file_map = self._build_transformer_file_map()
        self.tp_to_embedding_map = self._build_tp_other_layer_map(EMBEDDING_LAYER_INDEX)
        self.tp_to_final_norm_map = self._build_tp_other_layer_map(self.final_layer_norm_idx)

    # -- the light metadata kept from each model-state file ---------------------------------------
    @staticmethod
    def _lightweight_autoep_metadata(model_state):
        layers = model_state.get(_c.AUTOEP_LAYERS_KEY)
        if layers is None:
            layers = model_state.get(_c.AUTOEP_LAYERS_KEY_LEGACY)
        if not isinstance(layers, list):
            return _type_name_unless(layers, lambda v: False)
        return [{k: entry[k] for k in AUTOEP_METADATA_FIELDS if k in entry} if isinstance(entry, dict)
                else type(entry).__name__ for entry in layers]

    @staticmethod
    def _lightweight_ds_config(model_state):
        ds_config = model_state.get("ds_config", {})
        if not isinstance(ds_config, dict):
            return type(ds_config).__name__
        ordering = ds_config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False)
        return {USE_DATA_BEFORE_EXPERT_PARALLELISM: ordering if isinstance(ordering, bool) else type(ordering).__name__}

    @staticmethod
    def _lightweight_param_shapes(model_state):
        shapes = model_state.get(PARAM_SHAPES)
        if not isinstance(shapes, (list, tuple)) or not all(isinstance(group, dict) for group in shapes):
            return _type_name_unless(shapes, lambda v: False)
        return {name: shape for group in shapes for name, shape in group.items()}

    @staticmethod
    def _lightweight_parallel_dimensions(model_state):
        dims = model_state.get(CHECKPOINT_PARALLEL_DIMS)
        if not isinstance(dims, dict):
            return _type_name_unless(dims, lambda v: False)
        return {key: dims.get(key) for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE)}

    def _discover_model_state_metadata(self):
        """Load each model-state file once, keeping only the layout/converter metadata (see the module)."""
        metadata, global_state = [], {}
        for index, model_file in enumerate(self.mp_rank_files):
            state = _load(model_file)
            metadata.append((model_file, {
                CHECKPOINT_PARALLEL_DIMS: self._lightweight_parallel_dimensions(state),
                PARAM_SHAPES: self._lightweight_param_shapes(state),
                _c.AUTOEP_LAYERS_KEY: self._lightweight_autoep_metadata(state),
                "ds_config": self._lightweight_ds_config(state),
            }))
            if index == 0:
                global_state[ITERATION_KEY] = state.get(ITERATION_KEY, 0)
                for key in (ARGS_KEY, CHECKPOINT_INFO_KEY, UNIVERSAL_CHECKPOINT_INFO):
                    global_state[key] = state.get(key)
            del state
        return metadata, global_state

    # -- layout -----------------------------------------------------------------------------------
    def is_change_tp_degree(self):
        return self.tp_degree != self.zero_checkpoint.get_src_tp_degree()

    def is_change_pp_degree(self):
        return self.pp_degree != self.zero_checkpoint.get_src_pp_degree()

    def is_change_dp_degree(self):
        return self.dp_degree != self.zero_checkpoint.get_src_dp_degree()

    def show_2d_mapping(self):
        print("reshaped 2d map ---- begin")
        for i in range(self.pp_degree):
            for j in range(self.tp_degree):
                print(f"[{i}, {j}] = {self.get_2d_parallel_files(pp_index=i, tp_index=j)}")
        print("reshaped 2d map ---- end")

    def show_tp_embedding_map(self):
        self._dump_mapping(self.tp_to_embedding_map, "tp_to_embedding_layers")

    def show_tp_final_norm_map(self):
        self._dump_mapping(self.tp_to_final_norm_map, "tp_to_final_norm_layers")

    def show_pp_transformer_map(self):
        self._dump_mapping(self.pp_to_transformer_map, "pp_to_transformer_layers")

    def show_transformer_file_map(self):
        self._dump_mapping(self.transformer_file_map, "rank_to_transformer_files")

    # -- reading ----------------------------------------------------------------------------------
    def get_zero_checkpoint_state(self, pp_index, tp_index, dp_index, strip_tensor_paddings: bool = True) -> dict:
        return self.zero_checkpoint.get_state_for_rank(pp_index=pp_index, tp_index=tp_index, dp_index=dp_index,
                                                       keys_to_ignore=[PARAM_SHAPES],
                                                       strip_tensor_paddings=strip_tensor_paddings)

    def get_zero_files(self, pp_index, tp_index, dp_index) -> list:
        return self.zero_checkpoint.get_files_for_rank(pp_index=pp_index, tp_index=tp_index, dp_index=dp_index)

    def get_embedding_layer_id(self):
        return self.layer_keys[EMBEDDING_LAYER_INDEX]

    def get_final_norm_layer_id(self):
        return self.layer_keys[self.final_layer_norm_idx]

    def _get_checkpoint_value(self, key, default=None):
        if key not in self.global_state:
            self.global_state[key] = _load(self.mp_rank_files[0]).get(key, default)
        return self.global_state[key]

    def get_iteration(self):
        return self._get_checkpoint_value(ITERATION_KEY, 0)

    def get_args(self):
        return self._get_checkpoint_value(ARGS_KEY)

    def get_checkpoint_info(self, info_key=CHECKPOINT_INFO_KEY):
        return self._get_checkpoint_value(info_key)

    def get_embedding_state(self, tp_index: int) -> Dict:
        assert tp_index in self.tp_to_embedding_map
        return self._merge_state_dicts([_load(f) for f in self.tp_to_embedding_map[tp_index]])

    def get_embedding_files(self, tp_index: int) -> list:
        assert tp_index in self.tp_to_embedding_map
        return self.tp_to_embedding_map[tp_index]

    def get_2d_parallel_state(self, tp_index: int, pp_index: int) -> dict:
        merged = None
        for path in self.get_2d_parallel_files(tp_index=tp_index, pp_index=pp_index):
            state = _load(path)
            merged = state if merged is None else merge_state(merged, state)
        return merged

    def get_transformer_state(self, tp_index: int, pp_index: int) -> list:
        assert tp_index < self.tp_degree
        assert pp_index < self.pp_degree
        return [self._merge_state_dicts([_load(f) for f in files])
                for files in self.transformer_file_map[(tp_index, pp_index)]]

    def get_pp_transformer_map(self, pp_index: int) -> list:
        assert pp_index < self.pp_degree
        return self.pp_to_transformer_map[pp_index]

    def get_final_norm_state(self, tp_index: int) -> Dict:
        assert tp_index in self.tp_to_final_norm_map
        return _load(self.tp_to_final_norm_map[tp_index][0])

    def get_final_norm_files(self, tp_index: int) -> list:
        assert tp_index in self.tp_to_final_norm_map
        return self.tp_to_final_norm_map[tp_index]

    def get_2d_parallel_files(self, tp_index: int, pp_index: int) -> list:
        assert tp_index < self.tp_degree
        assert pp_index < self.pp_degree
        return [self.mp_rank_files[i] for i in self.new_2d_map.get_data(pp_index=pp_index, tp_index=tp_index)]

    # -- pipeline layer files ---------------------------------------------------------------------
    def _build_tp_other_layer_map(self, layer_index: int):
        if not self.layer_files:
            return {}
        assert layer_index <= len(self.layer_files)
        files = get_files_with_prefix(self.layer_files, self.layer_keys[layer_index])
        return dict(enumerate(partition_data(files, self.tp_degree)))

    def _build_pp_transformer_map(self):
        if self.pp_degree <= 0:
            return {}
        layers = self.layer_keys[1:self.final_layer_norm_idx]
        per_stage = len(layers) // self.pp_degree
        return {i: layers[i * per_stage:(i + 1) * per_stage] for i in range(self.pp_degree)}

    def _build_transformer_file_map(self):
        layers = self.layer_keys[1:self.final_layer_norm_idx]
        per_stage = len(layers) // self.pp_degree if self.pp_degree > 0 else 1
        file_map = {}
        for index, layer_key in enumerate(layers):
            stage = index // per_stage
            pieces = partition_data(get_files_with_prefix(self.layer_files, layer_key + "-"), self.tp_degree)
            for tp_index in range(self.tp_degree):
                file_map.setdefault((tp_index, stage), []).append(pieces[tp_index])
        return file_map

    def _get_layer_keys(self):
        ids = {re.search(LAYER_FILE_PREFIX_PATTERN, os.path.basename(p)).group(1) for p in self.layer_files}
        return [LAYER_FILE_PREFIX + layer_id for layer_id in sorted(ids, key=int)]

    def _merge_state_dicts(self, sd_list):
        return {key: (sd_list[0][key] if key in SEQUENTIAL_LAYERS
                      else torch.cat([sd[key] for sd in sd_list], dim=LAYER_CONCAT_DIM.get(key, 0)))
                for key in sd_list[0]}

    def _dump_mapping(self, data_map, map_tag=None):
        if map_tag is not None:
            print(f"Dump mapping: {map_tag}")
        for key, value in data_map.items():
            print(f"{key} = {value}")

    def _sanity_check(self):
        assert len(self.mp_rank_files) % self.tp_degree == 0
        assert self.zero_checkpoint.num_files % (self.pp_degree * self.tp_degree) == 0
        assert self.zero_checkpoint.num_files % self.tp_degree == 0

    def validate_files(self):
        for path in self.file_list:
            if not os.path.isfile(path):
                print(f"Error: {path} is not existent")

    def _validate_folder(self, dir, pipeline_parallel):
        basic_folder_validation(dir)
        prefixes = [MODEL_FILE_PREFIX]
        if pipeline_parallel:
            prefixes += [LAYER_FILE_PREFIX, f"{LAYER_FILE_PREFIX}01"]
        all_files = get_files(dir)
        for prefix in prefixes:
            assert get_files_with_prefix(all_files, prefix), (
                f"{dir} seems a bogus DeepSpeed checkpoint folder: Cannot find {prefix}* files in there.")
