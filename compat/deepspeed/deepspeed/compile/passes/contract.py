"""Pass contracts: what a DeepCompile pass needs from, and gives to, the passes scheduled before it.

A schedule is DeepCompile's ``[(step, [pass, ...]), ...]``. At each step the graph is compiled afresh
and the step's passes run left to right, so a requirement must be met by a pass earlier in the same
step. Two passes conflict when either one names the other in ``conflicts_with``. A pass with no
registered contract is unconstrained (it neither needs nor gives anything) but other passes may still
name it as a conflict.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Tuple

# capability tags the built-in passes trade in
CAP_Z3_GATHER_RELEASE = "z3_gather_release"  # ZeRO-3 all-gather / release ops are in the graph
CAP_OPT_STATES_EVICTED = "opt_states_evicted"  # optimizer state is off the accelerator while profiling


@dataclass(frozen=True)
class PassContract:
    """What a pass ``provides`` (capability tags), ``requires`` (tags an earlier pass of the same step
    must provide), which pass names it ``conflicts_with``, and which graph it rewrites (``phase``:
    ``"fwd"``, ``"bwd"`` or ``"both"``; descriptive only). The pass's name is its registry key."""

    provides: FrozenSet[str] = frozenset()
    requires: FrozenSet[str] = frozenset()
    conflicts_with: FrozenSet[str] = frozenset()
    phase: str = "both"


class PassContractError(ValueError):
    """A pass schedule breaks a registered pass contract."""


# pass name -> contract
_pass_contracts: Dict[str, PassContract] = {}

_NO_CONTRACT = PassContract()


def register_pass_contract(name: str, contract: Optional[PassContract]) -> None:
    """Record ``contract`` for the pass ``name``; ``None`` forgets any contract ``name`` had."""
    if contract is not None:
        _pass_contracts[name] = contract
    elif name in _pass_contracts:
        del _pass_contracts[name]


def get_pass_contract(name: str) -> Optional[PassContract]:
    return _pass_contracts.get(name)


def _pass_name(entry, name_registry: Optional[Dict[str, Callable]]) -> Optional[str]:
    """The registry name of a schedule entry: a name as is; a callable through ``name_registry`` (by
    identity); None for a callable that is not registered."""
    if isinstance(entry, str):
        return entry
    if not name_registry:
        return None
    names = sorted(name for name, fn in name_registry.items() if fn is entry)
    if len(names) > 1:
        raise PassContractError(f"the pass callable {getattr(entry, '__name__', entry)!r} is registered under "
                                f"multiple names {names}: write one of the names in the schedule instead")
    return names[0] if names else None


def _conflicts(name: str, contract: PassContract, earlier: Iterable[str]) -> List[str]:
    found = []
    for other in earlier:
        if other in contract.conflicts_with or name in _pass_contracts.get(other, _NO_CONTRACT).conflicts_with:
            found.append(other)
    return sorted(set(found))


def validate_schedule(schedule: List[Tuple[int, List]], name_registry: Optional[Dict[str, Callable]] = None) -> None:
    """Check every step of ``schedule`` against the registered contracts; raise :class:`PassContractError`
    at the first pass whose requirement no earlier pass of its step provides, or that conflicts with an
    earlier pass of its step. Entries are pass names or callables (resolved through ``name_registry``,
    ``{name: fn}``); callables it does not know are skipped."""
    for step, passes in schedule:
        have: set = set()
        seen: List[str] = []
        for entry in passes:
            name = _pass_name(entry, name_registry)
            if name is None:
                continue
            contract = _pass_contracts.get(name, _NO_CONTRACT)
            unmet = contract.requires - have
            if unmet:
                raise PassContractError(f"pass '{name}' at step {step} requires {sorted(unmet)}, which no pass "
                                        f"before it in that step provides (before it: {seen})")
            clash = _conflicts(name, contract, seen)
            if clash:
                raise PassContractError(f"pass '{name}' at step {step} conflicts with {clash}, scheduled before "
                                        "it in that step")
            have |= contract.provides
            seen.append(name)
