"""Selective AdamW: the AdamW update of chosen columns of each weight (the optimizer of ZenFlow's
important-column step; DeepSpeed's ``ZenFlowSelectiveAdamW`` and ``ZenFlowSelectiveAdamW_stage3``).

ZenFlow (DeepSpeed's stall-free offload) updates the few most important gradient columns of every
weight on the device at each step and the rest on the host later. This module is the first half's
optimizer on its own; ZenFlow's engine (choosing the columns, the host half) is not implemented, and a
config that switches ZenFlow on is refused by name. What is updated is given per parameter, with
DeepSpeed's attribute names, for one step at a time:

- ``selected_indices``: the columns (``weight[:, selected_indices]``); a 1-D parameter is updated whole;
- ``selected_grad``: their gradient, ``[rows, k]``; cleared by the step, and a parameter whose
  ``selected_grad`` is unset or None is left alone;
- ``temp_selected_param``: a snapshot of the columns (``temp_copy_param``), written back into the weight
  before the update and cleared by it.

Each parameter's moments (``exp_avg``, ``exp_avg_sq``) have the shape of its selected columns. With
``offload=True`` they live on the host in ``exp_avg_cpu_data`` / ``exp_avg_sq_cpu_data`` and are brought to
the device (as ``exp_avg`` / ``exp_avg_sq``) for the update of each bucket of about ``bucket_size``
elements. The update itself is torch's functional AdamW (``torch.optim.adamw.adamw``), so with every
column selected a step equals ``torch.optim.AdamW``'s.

``PartitionedSelectiveAdamW`` is the same for a ZeRO-3 partition laid out as DeepSpeed's ZenFlow lays it
out: the rank's ``ds_tensor`` holds the weight transposed (``ds_shape`` = (columns, rows)) from
``complete_column_offset`` for ``complete_numel`` elements, so the selected columns are rows of that view
and ``selected_grad`` is ``[k, rows]``; parameters are grouped by ``param.group_id``. A partition on NVMe
(``ds_tensor`` an empty placeholder, ``param.nvme_swapper``) is swapped in for its update and out after
it, one parameter at a time; a partition on another device than its gradient is updated on the
gradient's device and written back.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor
from torch.optim.adamw import adamw

__all__ = ["SelectiveAdamW", "PartitionedSelectiveAdamW"]

logger = logging.getLogger("shardwise")


def _selected(param) -> bool:
    return getattr(param, "selected_grad", None) is not None


class SelectiveAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW``'s arguments, plus ``offload`` (moments on the host) and ``bucket_size``."""

    def __init__(self, *args, offload: bool = False, bucket_size: float = 5e8, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.offload = offload
        self.bucket_size = bucket_size
        self.step = self._step_with_offload if offload else self._step_without_offload

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        for param_state in self.state.values():
            step = param_state.get("step")
            if torch.is_tensor(step) and step.dtype in (torch.float16, torch.bfloat16):
                param_state["step"] = step.float()

    # -- the selected columns ----------------------------------------------------------------------
    def _read(self, param) -> Tensor:
        """The selected columns: a copy for a 2-D weight, the parameter's data itself for a 1-D one."""
        return param.data if param.dim() == 1 else param.data[:, param.selected_indices]

    def _write(self, param, value: Tensor) -> None:
        if param.dim() == 1:
            if value is not param.data:
                param.data.copy_(value)
        else:
            param.data[:, param.selected_indices] = value.to(param.data.device)

    def _snapshot(self, param) -> Tensor:
        snap = self._read(param).clone().detach()
        return snap.cpu() if self.offload else snap

    def temp_copy_param(self, group_to_paramlist) -> None:
        """Snapshot the selected columns of every parameter (``{group index: [params]}``)."""
        for params in group_to_paramlist.values():
            for param in params:
                if hasattr(param, "selected_grad"):
                    param.temp_selected_param = self._snapshot(param)

    # -- moments -------------------------------------------------------------------------------------
    def copy_mv_from_cpu(self, params) -> None:
        for param in params:
            param.exp_avg = param.exp_avg_cpu_data.to(param.device, non_blocking=True)
            param.exp_avg_sq = param.exp_avg_sq_cpu_data.to(param.device, non_blocking=True)

    def copy_mv_to_cpu(self, params) -> None:
        for param in params:
            for host, moment in ((param.exp_avg_cpu_data, param.exp_avg), (param.exp_avg_sq_cpu_data, param.exp_avg_sq)):
                if moment.data_ptr() != host.data_ptr():  # (on a CPU run the moments were updated in place)
                    host.copy_(moment.data.reshape(host.shape), non_blocking=True)
            param.exp_avg = param.exp_avg_sq = None

    def clear_selected_mv(self) -> None:
        """Zero the moments (ZenFlow does so when it selects new columns)."""
        logger.info("selective AdamW: clearing the optimizer states of the selected columns")
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param)
                if not state:
                    continue
                if self.offload:
                    param.exp_avg_cpu_data.zero_()
                    param.exp_avg_sq_cpu_data.zero_()
                else:
                    state["exp_avg"].zero_()
                    state["exp_avg_sq"].zero_()

    # -- the update ----------------------------------------------------------------------------------
    @torch.no_grad()
    def _update(self, group, params, *, apply_snapshot: bool) -> None:
        """One AdamW step of the selected columns of ``params`` (all of one group)."""
        columns, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], [], [], []
        for param in params:
            grad = param.selected_grad
            cols = self._read(param).to(grad.device)
            snap = getattr(param, "temp_selected_param", None)
            if apply_snapshot and snap is not None:
                cols.copy_(snap.to(cols.device))
            state = self.state.setdefault(param, {})
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=cols.device)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(cols)
                if not self.offload:
                    state["exp_avg"] = torch.zeros_like(cols)
                    state["exp_avg_sq"] = torch.zeros_like(cols)
            if self.offload:
                param.exp_avg = param.exp_avg.to(cols.device)
                param.exp_avg_sq = param.exp_avg_sq.to(cols.device)
                exp_avgs.append(param.exp_avg.view_as(cols))  # views: the update lands in param.exp_avg
                exp_avg_sqs.append(param.exp_avg_sq.view_as(cols))
            else:
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
            if group["amsgrad"]:
                max_sqs.append(state["max_exp_avg_sq"])
            columns.append(cols)
            grads.append(grad)
            steps.append(state["step"])
        if not columns:
            return
        beta1, beta2 = group["betas"]
        adamw(columns, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, foreach=False, amsgrad=group["amsgrad"],
              beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
              maximize=group.get("maximize", False))
        for param, cols in zip(params, columns):
            self._write(param, cols)

    @torch.no_grad()
    def _step_without_offload(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if _selected(p)]
            self._update(group, params, apply_snapshot=True)
            for param in params:
                param.temp_selected_param = param.selected_grad = None

    @torch.no_grad()
    def group_step(self, group_to_paramlist) -> None:
        """The update of ``{group index: [params]}`` (their snapshots already written back)."""
        for group_id, params in group_to_paramlist.items():
            self._group_update(self.param_groups[group_id], [p for p in params if _selected(p)])

    def _group_update(self, group, params) -> None:
        if self.offload:
            self.copy_mv_from_cpu(params)
        self._update(group, params, apply_snapshot=False)
        if self.offload:
            self.copy_mv_to_cpu(params)
        for param in params:
            param.selected_grad = None

    def _apply_snapshot(self, param) -> None:
        snap = getattr(param, "temp_selected_param", None)
        if snap is not None:
            self._write(param, snap.to(param.device, non_blocking=True))
            param.temp_selected_param = None

    def _flush(self, group_id: int, bucket: list) -> None:
        for param in bucket:
            self._apply_snapshot(param)
        self.group_step({group_id: bucket})

    @torch.no_grad()
    def _step_with_offload(self) -> None:
        """Update in buckets of about ``bucket_size`` elements, the moments brought over per bucket."""
        for group_id, group in enumerate(self.param_groups):
            bucket, numel = [], 0
            for param in group["params"]:
                if not _selected(param):
                    continue
                bucket.append(param)
                numel += param.numel()
                if numel >= self.bucket_size:
                    self._flush(group_id, bucket)
                    bucket, numel = [], 0
            if bucket:
                self._flush(group_id, bucket)


class PartitionedSelectiveAdamW(SelectiveAdamW):
    """``SelectiveAdamW`` on ZeRO-3 partitions (see the module docstring)."""

    @staticmethod
    def _grid(param, data: Tensor) -> Tensor | None:
        """The partition as ``[columns, rows]`` (None for a 1-D parameter)."""
        if len(param.ds_shape) == 1:
            return None
        rows = param.ds_shape[1]
        return data.narrow(0, param.complete_column_offset, param.complete_numel).view(-1, rows)

    def _read(self, param) -> Tensor:
        data = param.ds_tensor.data
        grid = self._grid(param, data)
        return data if grid is None else grid[param.selected_indices.to(data.device), :]

    def _write(self, param, value: Tensor) -> None:
        data = param.ds_tensor.data
        grid = self._grid(param, data)
        if grid is None:
            if value is not data:
                data.copy_(value.to(data.device))
        else:
            grid[param.selected_indices.to(data.device), :] = value.to(data.device)

    def _apply_snapshot(self, param) -> None:
        if not self._off_device(param):  # an offloaded partition gets its snapshot in its own update
            super()._apply_snapshot(param)

    @staticmethod
    def _off_device(param) -> bool:
        data = param.ds_tensor.data
        return data.dim() == 0 or data.device != param.selected_grad.device

    @staticmethod
    def _swap_in(param) -> bool:
        if param.ds_tensor.data.dim() == 0 and getattr(param, "nvme_swapper", None) is not None:
            param.nvme_swapper.swap_in([param], async_op=False)
            return True
        return False

    def temp_copy_param(self, paramlist) -> None:
        """Snapshot the selected columns of each parameter of ``paramlist``; a partition on NVMe is read
        and released again without being written back."""
        for param in paramlist:
            if hasattr(param, "selected_grad"):
                swapped = self._swap_in(param)
                param.temp_selected_param = self._snapshot(param)
                if swapped:
                    param.nvme_swapper.remove_partition_and_release_buffers([param])

    def _one_at_a_time(self, group, params) -> None:
        for param in params:
            swapped = self._swap_in(param)
            if self.offload:
                self.copy_mv_from_cpu([param])
            self._update(group, [param], apply_snapshot=True)
            if self.offload:
                self.copy_mv_to_cpu([param])
            if swapped:
                param.nvme_swapper.swap_out_and_release([param])
            param.temp_selected_param = param.selected_grad = None

    @torch.no_grad()
    def _step_without_offload(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if _selected(p)]
            if any(self._off_device(p) for p in params):
                self._one_at_a_time(group, params)
                continue
            self._update(group, params, apply_snapshot=True)
            for param in params:
                param.temp_selected_param = param.selected_grad = None

    @torch.no_grad()
    def group_step(self, paramlist) -> None:
        """The update of ``paramlist``, grouped by each parameter's ``group_id``."""
        groups: dict[int, list] = {}
        for param in paramlist:
            if _selected(param):
                groups.setdefault(param.group_id, []).append(param)
        for group_id in sorted(groups):
            group, params = self.param_groups[group_id], groups[group_id]
            if any(self._off_device(p) for p in params):
                self._one_at_a_time(group, params)
            else:
                self._group_update(group, params)

    def _flush(self, group_id: int, bucket: list) -> None:
        for param in bucket:
            self._apply_snapshot(param)
        self.group_step(bucket)
