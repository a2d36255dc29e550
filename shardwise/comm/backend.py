"""A communication backend object over ``torch.distributed`` (DeepSpeed's ``TorchBackend``).

DeepSpeed's ``deepspeed.comm`` routes every collective through one backend object; scripts and
benchmarks build it themselves or read ``get_all_gather_function()`` off the class. This one joins
(or adopts) the default process group with ``shardwise.comm.init_distributed`` and sends each
collective through shardwise.comm, so the watchdog and the comms logger see them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.comm import comm as _c

__all__ = ["TorchBackend"]


class TorchBackend:
    """``TorchBackend(backend, timeout, init_method, rank=-1, world_size=-1, name='torch')``: joins the
    default process group if there is none (``init_distributed``), then wraps its collectives."""

    def __init__(self, backend, timeout, init_method, rank=-1, world_size=-1, name="torch") -> None:
        self.name = name
        self.world_group = None
        self.process_groups: list = []
        self.single_gpu_mode = True
        self.shm_comm_op = None
        self.has_all_reduce_coalesced = hasattr(dist, "all_reduce_coalesced")
        self.has_coalescing_manager = hasattr(getattr(dist, "distributed_c10d", None), "_coalescing_manager")
        self.all_gather_function = self.get_all_gather_function()
        self.reduce_scatter_function = self.get_reduce_scatter_function()
        self.init_process_group(backend, timeout, init_method, rank, world_size)
        self.initialized = True
        self.world_size = self.get_world_size()
        self.world_rank = self.get_rank()

    # -- the class-level helpers DeepSpeed's benchmarks read ---------------------------------------
    @classmethod
    def get_all_gather_function(cls):
        """``torch.distributed.all_gather_into_tensor`` (``(output, input, group=, async_op=)``)."""
        return getattr(dist, "all_gather_into_tensor", None) or getattr(dist, "_all_gather_base", None)

    @classmethod
    def get_reduce_scatter_function(cls):
        return getattr(dist, "reduce_scatter_tensor", None) or getattr(dist, "_reduce_scatter_base", None)

    def has_all_gather_into_tensor(self) -> bool:
        return self.all_gather_function is not None

    def has_reduce_scatter_tensor(self) -> bool:
        return self.reduce_scatter_function is not None

    def init_process_group(self, backend, timeout, init_method, rank, world_size) -> None:
        if not dist.is_initialized():
            _c.init_distributed(dist_backend=backend, timeout=timeout, init_method=init_method, rank=rank,
                                world_size=world_size, verbose=False)
        self.using_mpi = dist.get_backend() == "mpi"

    def is_initialized(self) -> bool:
        return self.initialized and dist.is_initialized()

    # -- collectives ---------------------------------------------------------------------------------
    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return _c.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def inference_all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None):
        if dist.get_world_size(group=group) > 1:
            _c.all_reduce(tensor, op=op, group=group)
        return tensor

    def all_reduce_coalesced(self, tensors, op=dist.ReduceOp.SUM, group=None, async_op=False):
        """All-reduce each tensor of the list (one flat buffer per dtype and device)."""
        by_kind: dict = {}
        for t in tensors:
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        for same in by_kind.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            _c.all_reduce(flat, op=op, group=group)
            offset = 0
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        return None

    def reduce(self, tensor, dst, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return _c.reduce(tensor, dst, op=op, group=group, async_op=async_op)

    def reduce_scatter(self, output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)

    def reduce_scatter_tensor(self, output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return _c.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    def broadcast(self, tensor, src, group=None, async_op=False):
        return _c.broadcast(tensor, src, group=group, async_op=async_op)

    def broadcast_object_list(self, object_list, src, group=None, device=None):
        return dist.broadcast_object_list(object_list, src=src, group=group, device=device)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        return _c.all_gather(tensor_list, tensor, group=group, async_op=async_op)

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        return _c.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    all_gather_base = all_gather_into_tensor

    def all_gather_coalesced(self, output_tensors, input_tensors, group=None, async_op=False):
        for out, inp in zip(output_tensors, input_tensors):
            _c.all_gather_into_tensor(out, inp, group=group)
        return None

    def all_gather_object(self, object_list, obj, group=None):
        return dist.all_gather_object(object_list=object_list, obj=obj, group=group)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        return _c.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                    input_split_sizes=input_split_sizes, group=group, async_op=async_op)

    def all_to_all(self, output_tensor_list, input_tensor_list, group=None, async_op=False):
        return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)

    def send(self, tensor, dst, group=None, tag=0):
        return _c.send(tensor, dst, group=group, tag=tag)

    def recv(self, tensor, src=None, group=None, tag=0):
        return _c.recv(tensor, src=src, group=group, tag=tag)

    def isend(self, tensor, dst, group=None, tag=0):
        return _c.isend(tensor, dst, group=group, tag=tag)

    def irecv(self, tensor, src=None, group=None, tag=0):
        return _c.irecv(tensor, src=src, group=group, tag=tag)

    def batch_isend_irecv(self, p2p_op_list):
        return dist.batch_isend_irecv(p2p_op_list)

    def gather(self, tensor, gather_list=None, dst=0, group=None, async_op=False):
        return _c.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)

    def scatter(self, tensor, scatter_list=None, src=0, group=None, async_op=False):
        return _c.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)

    def barrier(self, group=None, async_op=False, device_ids=None):
        return _c.barrier(group=group, async_op=async_op, device_ids=device_ids)

    def monitored_barrier(self, group=None, timeout=None, wait_all_ranks=False):
        return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)

    # -- queries ---------------------------------------------------------------------------------------
    def get_rank(self, group=None) -> int:
        return dist.get_rank(group=group)

    def get_world_size(self, group=None) -> int:
        return dist.get_world_size(group=group)

    def get_backend(self, group=None) -> str:
        return dist.get_backend(group=group)

    def new_group(self, ranks):
        return _c.new_group(ranks)

    def get_global_rank(self, group, group_rank) -> int:
        return dist.get_global_rank(group, group_rank)

    def get_world_group(self):
        return dist.group.WORLD

    def destroy_process_group(self, group=None) -> None:
        return dist.destroy_process_group(group=group)

    def init_device_mesh(self, mesh_shape, mesh_dim_names):
        from torch.distributed.device_mesh import init_device_mesh

        from shardwise.accelerator import get_accelerator

        return init_device_mesh(get_accelerator().device_name(), mesh_shape, mesh_dim_names=mesh_dim_names)
