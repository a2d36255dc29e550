"""Capturing the real inputs of AOT autograd's compiled backward, per DeepCompile frame.

While patched, ``torch.autograd.Function`` is a subclass whose metaclass wraps the backward entry of
every class named ``CompiledFunction`` that AOT autograd creates (``_backward_impl`` from torch 2.7,
``_backward_prologue`` on 2.6): the class takes the next frame key queued by
:func:`register_backward_frame`, and each backward call made while the patch is enabled appends its
inputs under that key (and drops the class's cached ``compiled_bw`` so the backward is compiled again
with those inputs).
"""
from __future__ import annotations

from collections import deque

import torch

from deepspeed.utils.torch import required_torch_version

backward_inputs = {}  # frame key -> [captured backward inputs, ...]
backward_frame_keys = deque()  # frame keys waiting for their CompiledFunction class

enabled_patched_func = False
original_grad_fn = None
base_meta = type(torch.autograd.Function)


def _unwrap_staticmethod(method):
    return method.__func__ if isinstance(method, staticmethod) else method


def _capturing(original, frame_key, after: bool):
    """Wrap a CompiledFunction backward entry: record its inputs (``after``: its return value, which is
    what the backward receives when the entry is the prologue) for ``frame_key``."""

    def record(owner, args):
        if enabled_patched_func and frame_key is not None:
            backward_inputs.setdefault(frame_key, []).append(args)
            owner.compiled_bw = None

    if after:
        def wrapped(ctx, *grad_outputs):
            assert original is not None, "CompiledFunction has no _backward_prologue"
            args = original(ctx, *grad_outputs)
            record(wrapped.owner_class, args)
            return args
    else:
        def wrapped(ctx, all_args):
            assert original is not None, "CompiledFunction has no _backward_impl"
            record(wrapped.owner_class, all_args)
            return original(ctx, all_args)

    wrapped.owner_class = None
    return wrapped


_ENTRY = "_backward_impl" if required_torch_version(min_version=2.7) else "_backward_prologue"


class FunctionMeta(base_meta):
    """Metaclass of the patched ``torch.autograd.Function``: wraps ``CompiledFunction``'s backward entry."""

    def __new__(cls, name, bases, dct):
        if name != "CompiledFunction":
            return super().__new__(cls, name, bases, dct)
        frame_key = backward_frame_keys.popleft() if backward_frame_keys else None
        wrapped = _capturing(_unwrap_staticmethod(dct.get(_ENTRY)), frame_key, after=_ENTRY == "_backward_prologue")
        dct[_ENTRY] = staticmethod(wrapped)
        new_class = super().__new__(cls, name, bases, dct)
        wrapped.owner_class = new_class
        return new_class


def patch_compiled_func():
    """Enable capture and install the patched ``torch.autograd.Function``; returns the capture dict."""
    global enabled_patched_func, original_grad_fn
    enabled_patched_func = True

    class PatchedFunction(torch.autograd.Function, metaclass=FunctionMeta):
        pass

    original_grad_fn = torch.autograd.Function
    torch.autograd.Function = PatchedFunction
    return backward_inputs


def register_backward_frame(frame_key):
    """The next ``CompiledFunction`` AOT autograd creates belongs to ``frame_key``."""
    backward_frame_keys.append(frame_key)


def unpatch_compiled_func():
    """Disable capture, put back the original ``torch.autograd.Function`` and drop all captured inputs."""
    global enabled_patched_func, original_grad_fn
    enabled_patched_func = False
    if original_grad_fn is not None:
        torch.autograd.Function = original_grad_fn
        original_grad_fn = None
    clear_backward_inputs()


def get_backward_inputs(frame_key=None):
    """All captured inputs (the dict itself) or, for ``frame_key``, its list (``[]`` when none)."""
    return backward_inputs if frame_key is None else backward_inputs.get(frame_key, [])


def pop_backward_input(frame_key):
    """Take the most recent captured inputs of ``frame_key``; None when it has none."""
    captured = backward_inputs.get(frame_key)
    if not captured:
        return None
    inputs = captured.pop()
    if not captured:
        del backward_inputs[frame_key]
    return inputs


def clear_backward_inputs(frame_keys=None):
    """Forget the captured inputs and queued frame registrations of ``frame_keys`` (all when None)."""
    if frame_keys is None:
        backward_inputs.clear()
        backward_frame_keys.clear()
        return
    drop = set(frame_keys)
    for key in drop:
        backward_inputs.pop(key, None)
    keep = [key for key in backward_frame_keys if key not in drop]
    backward_frame_keys.clear()
    backward_frame_keys.extend(keep)
