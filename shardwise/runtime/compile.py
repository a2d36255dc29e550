"""Compiled training: ``engine.compile()`` runs the model's repeated blocks through ``torch.compile``.

As torchtitan does, each repeated block (the children of the first module, top-down, that holds two or
more children of one class which have submodules of their own: a transformer's layers) is compiled on
its own; the embedding, head and anything between stays eager. A model without repeated blocks is
compiled whole. Only the block's ``forward`` is compiled, in place: parameter names, ``state_dict``
and checkpoints do not change, and the module's own hooks run eagerly around the compiled graph.

That is what keeps ZeRO outside the graphs:

* stages 0-2 reduce gradients from hooks on the parameters (``register_post_accumulate_grad_hook``),
  which autograd runs after the compiled backward has produced the block's gradients;
* stage 3 gathers a module's parameters in forward hooks on that module. Hooks on modules inside a
  compiled block would be traced into the graph, so the block's hooks are merged into one pair on the
  block itself (``ParamCoordinator.gather_as_one``): the whole block is gathered before its compiled
  forward and released after, and gathered again before its backward.

No graph break per parameter and no recompilation per step: the blocks share one compiled graph
(torch inlines ``nn.Module`` calls and lifts parameters to graph inputs), checked in
tests/test_compile.py with ``torch._dynamo.utils.counters``.
"""

from __future__ import annotations

import logging
import shutil
from collections import Counter

import torch

logger = logging.getLogger("shardwise")

__all__ = ["compile_model", "repeated_blocks", "check_backend"]


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of ``module`` (see the module docstring), or [] when there are none."""
    queue = [module]
    while queue:
        m = queue.pop(0)
        children = list(m.children())
        kinds = Counter(type(c) for c in children if any(True for _ in c.children()))
        if kinds:
            kind, count = kinds.most_common(1)[0]
            if count >= 2:
                return [c for c in children if type(c) is kind]
        queue.extend(children)
    return []


def check_backend(backend, *, device: torch.device) -> None:
    """Inductor on the CPU writes C++ and needs a compiler: say so now rather than at the first step."""
    if backend != "inductor" or device.type != "cpu":
        return
    from torch._inductor import config as inductor_config

    candidates = inductor_config.cpp.cxx
    candidates = candidates if isinstance(candidates, (list, tuple)) else (candidates,)
    named = [c for c in candidates if c is not None]
    if any(shutil.which(c) for c in named):
        return
    raise ValueError(f"engine.compile(backend='inductor') on the CPU needs a C++ compiler and none was found "
                     f"(looked for {', '.join(repr(c) for c in named)}: inductor reads the CXX environment "
                     "variable, else g++). Install one (Debian/Ubuntu: apt-get install g++), point CXX at one, or "
                     "use backend='aot_eager' (compiled graphs without generated kernels)")


def compile_model(module: torch.nn.Module, *, backend, kwargs: dict, coordinator=None) -> list[torch.nn.Module]:
    """Compile ``module``'s repeated blocks (else ``module``) in place; return the compiled modules.
    ``coordinator``: ZeRO-3's parameter coordinator, whose hooks inside each block are merged onto it."""
    blocks = repeated_blocks(module) or [module]
    for block in blocks:
        if coordinator is not None:
            coordinator.gather_as_one(block)
        block.forward = torch.compile(block.forward, backend=backend, **kwargs)
    logger.info("compiled %d module(s) of class %s with backend %s", len(blocks), type(blocks[0]).__name__, backend)
    return blocks
