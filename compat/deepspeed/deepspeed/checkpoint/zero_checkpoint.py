"""``deepspeed.checkpoint.zero_checkpoint``: ``ZeROCheckpoint``, the ZeRO optimizer-state files of a DeepSpeed
checkpoint folder laid out by (pipeline, tensor, data) rank, and the merged state a rank of a smaller target
layout loads (its source files merged with ``reshape_utils.merge_state``; the data-parallel padding of each
parameter group stripped unless asked not to, and ``partition_count`` set to the target data degree)."""
import torch

from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, GROUP_PADDINGS, OPTIMIZER_STATE_DICT, PARTITION_COUNT
from deepspeed.checkpoint.reshape_3d_utils import get_model_3d_descriptor, model_3d_desc
from deepspeed.checkpoint.reshape_utils import basic_folder_validation, get_zero_files, merge_state

__all__ = ["GROUP_STATE_KEY", "ZeROCheckpoint"]

GROUP_STATE_KEY = "state"


class ZeROCheckpoint:
    """The ZeRO files of ``dir``; ``source_3d`` is the layout they were written with (read from the folder's
    model-state files when not given)."""

    def __init__(self, dir, source_3d=None):
        basic_folder_validation(dir)
        self.dir = dir
        self.file_list = get_zero_files(dir)
        self.num_files = len(self.file_list)
        assert self.num_files > 0, f"No ZeRO files found in {dir}"
        self.src_3d = get_model_3d_descriptor(dir) if source_3d is None else source_3d
        self.target_3d = model_3d_desc(pp_degree=self.src_3d.pp_degree, tp_degree=self.src_3d.tp_degree,
                                       dp_degree=self.src_3d.dp_degree)
        self._3d_file_map = self.src_3d.reshape(self.target_3d)

    def get_src_world_size(self):
        return self.src_3d.world_size()

    def get_src_tp_degree(self):
        return self.src_3d.tp_degree

    def get_src_pp_degree(self):
        return self.src_3d.pp_degree

    def get_src_dp_degree(self):
        return self.src_3d.dp_degree

    def get_file_indices_for_rank(self, pp_index, tp_index, dp_index):
        assert dp_index < len(self._3d_file_map), f"DP index {dp_index} >= DP degree {len(self._3d_file_map)}"
        return self._3d_file_map[dp_index].get_data(pp_index, tp_index)

    def get_files_for_rank(self, pp_index, tp_index, dp_index):
        return [self.file_list[i] for i in self.get_file_indices_for_rank(pp_index, tp_index, dp_index)]

    def get_state_for_rank(self, pp_index, tp_index, dp_index, keys_to_ignore=[], strip_tensor_paddings=True):  # noqa: B006
        merged = None
        for path in self.get_files_for_rank(pp_index, tp_index, dp_index):
            state = torch.load(path, map_location=torch.device("cpu"), weights_only=False)
            for key in keys_to_ignore:
                state.pop(key, None)
            if strip_tensor_paddings:
                self._strip_tensor_paddings(state)
            merged = state if merged is None else merge_state(merged, state)
            self._update_partition_count(merged)
            if strip_tensor_paddings:
                self._clear_group_paddings(merged)
        return merged

    def print_3d_index_map(self, tag=None):
        if tag:
            print(f"3D index map: {tag}")
        for dp_index, map_2d in enumerate(self._3d_file_map):
            map_2d.print_data(f"dp = {dp_index}")

    def print_3d_file_map(self, tag=None):
        if tag:
            print(f"3D file map: {tag}")
        for dp_index, map_2d in enumerate(self._3d_file_map):
            for pp_index in range(map_2d.pp_degree):
                for tp_index in range(map_2d.tp_degree):
                    files = [self.file_list[i] for i in map_2d.get_data(pp_index, tp_index)]
                    print(f"{pp_index}, {tp_index}, {dp_index} => {files}")

    def reshape(self, target_3d_desc: model_3d_desc):
        self.target_3d = target_3d_desc
        self._3d_file_map = self.src_3d.reshape(self.target_3d)

    def _strip_tensor_paddings(self, sd):
        group_states = self._get_param_group_states(sd)
        paddings = self._get_optimizer_state(sd, GROUP_PADDINGS)
        if group_states is None or paddings is None:
            return
        for key, group_state in group_states.items():
            if paddings[key] == 0:
                continue
            for name, value in group_state.items():
                if name != "step" and torch.is_tensor(value):
                    group_state[name] = torch.narrow(value, 0, 0, value.numel() - paddings[key]).clone()

    def _clear_group_paddings(self, sd):
        paddings = self._get_optimizer_state(sd, GROUP_PADDINGS)
        if paddings:
            sd[OPTIMIZER_STATE_DICT][GROUP_PADDINGS] = [0] * len(paddings)

    def _get_optimizer_state(self, sd, state_key):
        optimizer_state = sd.get(OPTIMIZER_STATE_DICT)
        return None if optimizer_state is None else optimizer_state.get(state_key)

    def _get_param_group_states(self, sd):
        base = self._get_optimizer_state(sd, BASE_OPTIMIZER_STATE)
        return None if base is None else base.get(GROUP_STATE_KEY)

    def _update_partition_count(self, sd):
        counts = self._get_optimizer_state(sd, PARTITION_COUNT)
        if counts:
            sd[OPTIMIZER_STATE_DICT][PARTITION_COUNT] = [self.target_3d.dp_degree] * len(counts)
