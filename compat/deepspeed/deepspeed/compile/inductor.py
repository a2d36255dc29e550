"""DeepCompile's inductor wiring (``deepspeed.compile.inductor``): wrapping AOT autograd's compilers and
partitioner so DeepCompile's graph passes run inside them, a restorable patch of ``AotAutograd``'s
constructor that installs that wrapping for one graph, and the inductor lowerings for DeepCompile's
``dc`` ops."""
from __future__ import annotations

import functools
import re
from typing import Set

import torch

try:
    import torch.utils._pytree as pytree
    from torch._inductor.ir import FallbackKernel, IRNode, Layout, TensorBox
    from torch._inductor.lowering import add_needs_realized_inputs, fallbacks, register_lowering
    from torch._inductor.scheduler import Scheduler
    from torch._inductor.virtualized import V
except ImportError:  # a torch without inductor
    pass

from deepspeed.utils.torch import required_torch_version

from .partitioner import get_wrapped_partitioner
from .util import get_input_nodes


def _get_graphsafe_run_with_rng_state():
    """torch's ``graphsafe_run_with_rng_state`` higher-order op, or None where this torch has none."""
    try:
        from torch._prims import rng_prims
    except ImportError:
        return None
    return getattr(rng_prims, "graphsafe_run_with_rng_state", None)


def _register_graphsafe_rng_state_no_reuse(register_fallback_no_reuse):
    """Register ``graphsafe_run_with_rng_state`` through ``register_fallback_no_reuse`` with its outputs
    never reused; False where the op does not exist."""
    op = _get_graphsafe_run_with_rng_state()
    if op is None:
        return False
    register_fallback_no_reuse(op, never_reuse_output=True)
    return True


def _mark_output_never_reuse(out, *, enabled):
    """Add an IR node output's buffer to the current graph's ``never_reuse_buffers`` (when ``enabled``);
    returns ``out`` unchanged. Other values pass through untouched."""
    if enabled and isinstance(out, IRNode):
        V.graph.never_reuse_buffers.add(out.get_name())
    return out


def patch_compiler(original_compiler, dc_compiler, z3_partition: bool, graph_id, graph_param_manager, bwd: bool):
    """A compiler that runs ``dc_compiler`` (DeepCompile's passes) on the graph, then ``original_compiler``;
    under ZeRO-3 the parameter inputs are handed on as empty fake tensors (the shape inductor checks
    inputs against is the partitioned one)."""

    def wrapped_compiler(gm, fake_inputs):
        if dc_compiler(gm, fake_inputs) is None:
            return None  # symbolic-int graphs: nothing to compile here
        if not z3_partition:
            return original_compiler(gm, fake_inputs)

        from torch._dynamo.utils import to_fake_tensor
        from torch._subclasses.fake_tensor import is_fake

        manager = graph_param_manager[graph_id]
        if bwd:
            param_names = {n.name for n in manager.get_bwd_mapping(gm.graph)[0]}
        else:
            param_names = set(manager.param_names)
        patched = []
        for node, value in zip(get_input_nodes(gm.graph), fake_inputs):
            if node.name in param_names:
                assert is_fake(value), f"parameter input {node.name} should be a fake tensor, got {type(value)}"
                value = to_fake_tensor(torch.empty([0], dtype=value.dtype, device=value.device), value.fake_mode)
            patched.append(value)
        return original_compiler(gm, tuple(patched))

    return wrapped_compiler


def wrap_partition_fn(z3_partition: bool, partition_fn, real_inputs, param_indices, frame_id: int,
                      frames_partitioned: Set[int]):
    """``partition_fn`` wrapped by :func:`~deepspeed.compile.partitioner.get_wrapped_partitioner`; under
    ZeRO-3 the parameter placeholders of both partitions get empty ``val`` metadata."""

    def wrapped_partition_fn(*args, **kwargs):
        fn = get_wrapped_partitioner(z3_partition, param_indices, partition_fn=partition_fn, frame_id=frame_id,
                                     frames_partitioned=frames_partitioned)
        fw_module, bw_module = fn(*args, **kwargs)
        if z3_partition:
            from .graph_param import DSGraphParamManager

            names = set(DSGraphParamManager(fw_module.graph, real_inputs, param_indices).param_names)
            for module in (fw_module, bw_module):
                for n in module.graph.nodes:
                    if n.op == "placeholder" and n.name in names:
                        val = n.meta["val"]
                        n.meta["val"] = torch.empty([0], dtype=val.dtype, device=val.device)
        return fw_module, bw_module

    return wrapped_partition_fn


def _patch_deepcompile_aot_kwargs(kwargs: dict, *, graph_id: int, z3_partition: bool, make_fw_graph, make_bw_graph,
                                  real_inputs, param_indices, param_manager, frame_id: int,
                                  frames_partitioned: Set[int]) -> bool:
    """Rewrite ``AotAutograd``'s constructor ``kwargs`` in place so DeepCompile's forward/backward graph
    makers run inside its compilers and partitioner. Backends whose kwargs lack ``fw_compiler`` or
    ``partition_fn`` (torch_xla's openxla, ...) are left alone: returns False. Without a
    ``bw_compiler`` the forward compiler compiles the backward too; ``inference_compiler`` becomes the
    wrapped forward compiler."""
    fw_compiler = kwargs.get("fw_compiler")
    partition_fn = kwargs.get("partition_fn")
    if not fw_compiler or not partition_fn:
        return False
    bw_compiler = kwargs.get("bw_compiler") or fw_compiler
    kwargs["fw_compiler"] = patch_compiler(fw_compiler, make_fw_graph, z3_partition, graph_id, param_manager,
                                           bwd=False)
    kwargs["bw_compiler"] = patch_compiler(bw_compiler, make_bw_graph, z3_partition, graph_id, param_manager,
                                           bwd=True)
    kwargs["inference_compiler"] = kwargs["fw_compiler"]
    kwargs["partition_fn"] = wrap_partition_fn(z3_partition, partition_fn, real_inputs, param_indices, frame_id,
                                               frames_partitioned)
    return True


_ORIGINAL_INIT = "__original_init"  # the class attribute holding the constructor a patch replaced


def patch_create_aot_dispatcher_function(graph_id: int, z3_partition: bool, make_fw_graph, make_bw_graph, real_inputs,
                                         param_indices, param_manager, frame_id: int, frames_partitioned: Set[int]):
    """Patch ``torch._dynamo.backends.common.AotAutograd.__init__`` so the AOT compilers built next carry
    DeepCompile's wiring for this graph (:func:`_patch_deepcompile_aot_kwargs`). An earlier patch still
    installed is taken off first. Returns a restore callback that removes this patch only while it is
    the installed one (so it never undoes a newer patch) and may be called any number of times."""
    from torch._dynamo.backends.common import AotAutograd

    if hasattr(AotAutograd, _ORIGINAL_INIT):
        AotAutograd.__init__ = getattr(AotAutograd, _ORIGINAL_INIT)
        delattr(AotAutograd, _ORIGINAL_INIT)
    original_init = AotAutograd.__init__

    @functools.wraps(original_init)
    def patched_init(self, **kwargs):
        _patch_deepcompile_aot_kwargs(kwargs, graph_id=graph_id, z3_partition=z3_partition,
                                      make_fw_graph=make_fw_graph, make_bw_graph=make_bw_graph,
                                      real_inputs=real_inputs, param_indices=param_indices,
                                      param_manager=param_manager, frame_id=frame_id,
                                      frames_partitioned=frames_partitioned)
        original_init(self, **kwargs)

    setattr(AotAutograd, _ORIGINAL_INIT, original_init)
    AotAutograd.__init__ = patched_init

    def restore_aotautograd():
        if AotAutograd.__init__ is not patched_init:
            return
        AotAutograd.__init__ = original_init
        if getattr(AotAutograd, _ORIGINAL_INIT, None) is original_init:
            delattr(AotAutograd, _ORIGINAL_INIT)

    return restore_aotautograd


def _fallback_handler(kernel, never_reuse_input, never_reuse_output, force_free_input, block_input_reuse=False,
                      add_to_fallback_set=True):
    """An inductor lowering that runs ``kernel`` as a fallback kernel, keeping inductor from reusing
    its output buffers (``never_reuse_output``) or its inputs' (``never_reuse_input`` with
    ``force_free_input``, or ``block_input_reuse``), and with ``force_free_input`` dropping the
    reference to its first input right after the call."""
    if add_to_fallback_set:
        fallbacks.add(kernel)
    guard_inputs = force_free_input or block_input_reuse

    def handler(*args, **kwargs):

        class DCKernel(FallbackKernel):

            def __init__(self, op, *a, **kw):
                super().__init__(op, *a, **kw)
                if never_reuse_input or block_input_reuse:
                    pytree.tree_map(lambda x: V.graph.never_reuse_buffers.add(x.get_name())
                                    if isinstance(x, IRNode) else None, a)

            def codegen(self, wrapper):
                if not force_free_input:
                    return super().codegen(wrapper)
                self.codegen_comment(wrapper)
                args_code = [*self.codegen_args(), *self.codegen_kwargs()]
                if required_torch_version(min_version=2.8):
                    V.graph.wrapper_code.generate_fallback_kernel(self)
                else:
                    V.graph.wrapper_code.generate_fallback_kernel(self, args_code)
                if isinstance(self.layout, Layout):
                    self.codegen_size_asserts(wrapper)
                first = args_code[0] if args_code else ""
                match = re.match(r"reinterpret_tensor\((\w+),", first)
                name = first if first.isidentifier() else (match.group(1) if match else None)
                if name:
                    wrapper.writeline(f"{name} = None")
                self.codegen_unbacked_symbol_defs(wrapper)

        def wrap(x):
            out = TensorBox.create(x) if isinstance(x, IRNode) else x
            return _mark_output_never_reuse(out, enabled=never_reuse_output)

        kernel_cls = DCKernel if guard_inputs else FallbackKernel
        return pytree.tree_map(wrap, kernel_cls.create(kernel, *args, **kwargs))

    return handler


def register_custom_ops():
    """Register inductor lowerings for DeepCompile's ``dc`` ops (all must be defined) and for
    ``graphsafe_run_with_rng_state``, and keep inductor's scheduler from dropping them as dead code."""

    def register_fallback_no_reuse(op_overload, never_reuse_input=False, never_reuse_output=False,
                                   force_free_input=False, block_input_reuse=False):
        add_needs_realized_inputs(op_overload)
        return register_lowering(op_overload, type_promotion_kind=None)(_fallback_handler(
            op_overload, never_reuse_input=never_reuse_input, never_reuse_output=never_reuse_output,
            force_free_input=force_free_input, block_input_reuse=block_input_reuse))

    dc = torch.ops.dc
    # (op, never_reuse_input, never_reuse_output, force_free_input)
    for op, reuse_in, reuse_out, free_in in (
        (dc.allgather_param.default, False, True, False),
        (dc.wait_allgather.default, True, True, False),
        (dc.release_param.default, True, False, False),
        (dc.reduce_grad.default, True, True, True),
        (dc.free_tensors.default, True, True, False),
        (dc.offload_tensor.default, False, True, False),
        (dc.wait_offload.default, True, True, False),
        (dc.reload_tensor.default, True, True, False),
        (dc.wait_reload.default, True, True, False),
        (dc.end_backward.default, True, False, False),
    ):
        register_fallback_no_reuse(op, never_reuse_input=reuse_in, never_reuse_output=reuse_out,
                                   force_free_input=free_in)
    _register_graphsafe_rng_state_no_reuse(register_fallback_no_reuse)

    if not getattr(Scheduler, "is_dc_patched", False):
        Scheduler.is_dc_patched = True
        Scheduler.dead_node_elimination = lambda _: None
