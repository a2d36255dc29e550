"""Which process group each parameter's gradient is reduced (and its optimizer state partitioned) over,
and the names checkpoints give parameters.

A ZeRO strategy lays its trainable parameters out in flat buffers (``zero/flat.py``), one set per
``ReduceDomain``; each bucket of a buffer is reduced over its domain's group, with its domain's scale.
The plain layout (``ParamLayout``) has one domain, the data group. A model with MoE layers has one more
per expert-data-parallel group: its experts' buffers are reduced over that group (``shardwise/moe/layout.py:
ExpertLayout``), as Megatron-Core's distributed optimizer keeps separate buffers for expert parameters.
One strategy and one optimizer step every domain; the gradient norm counts each element once because
the domains say which ranks hold the other pieces (``ReduceDomain.norm_group``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise import comm


@dataclass(frozen=True)
class ReduceDomain:
    """Parameters whose gradients are reduced, and whose optimizer state is partitioned, over one group."""

    name: str | None  # None: the dense parameters (the data group); experts: their group name ("ep_size_2")
    group: object  # the process group (None: the world)
    world: int
    rank: int
    grad_scale: float = 1.0  # times the reduced gradient (experts: the tensor ranks sharing slots / ep_size)
    norm_group: object = None  # replicated stages: the group holding this domain's other pieces of the norm
    norm_world: int = 1  # its size (1: this rank holds every piece)

    @classmethod
    def of(cls, group, *, name: str | None = None, grad_scale: float = 1.0, norm_group=None) -> ReduceDomain:
        return cls(name, group, comm.get_world_size(group), comm.get_rank(group), float(grad_scale), norm_group,
                   comm.get_world_size(norm_group) if norm_group is not None else 1)


class ParamLayout:
    """The plain layout: every parameter in one domain, the data group; names as the module's."""

    has_experts = False
    saved_names: dict[str, str] = {}  # {module name: the name fragments and checkpoints use}
    held_elsewhere: frozenset[str] = frozenset()  # names a whole-module state dict has that this rank does not hold
    expert_names: frozenset[str] = frozenset()  # every name of an expert parameter (module and saved names)

    def __init__(self, dp_group=None) -> None:
        self.dp_group = dp_group

    def named(self, named_params: list[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.nn.Parameter]]:
        """``named_params`` under the names the strategy's fragments carry."""
        return list(named_params)

    def domains(self, named_params) -> list[tuple[ReduceDomain, list[tuple[str, torch.nn.Parameter]]]]:
        """``(domain, its parameters)`` for every domain, in a fixed order (the dense one first)."""
        return [(ReduceDomain.of(self.dp_group), list(named_params))]

    def partition_group(self, p: torch.nn.Parameter):
        """The group ZeRO-3 shards ``p`` over."""
        return self.dp_group

    def grad_scale(self, p: torch.nn.Parameter) -> float:
        return 1.0

    def whole_state(self, module: torch.nn.Module, state: dict) -> dict:
        """The stage's module state dict as a whole-model one (experts: gathered, by global index)."""
        return state

    def local_state(self, state: dict) -> dict:
        """A whole-model state dict cut to what this rank's module holds, under the module's names."""
        return state
