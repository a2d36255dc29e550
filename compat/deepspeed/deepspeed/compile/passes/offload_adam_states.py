"""DeepCompile's optimizer-state offload passes: their names and contracts."""
from .contract import CAP_OPT_STATES_EVICTED, PassContract

NAME = "offload_adam_states"
NAME_SYNC = "offload_adam_states_sync"
NAME_FOR_INIT = "offload_adam_states_for_init"

# one offload target per run, and the optimizer state these move exists only under ZeRO-3
_INCOMPATIBLE = frozenset({"offload_parameters", "zero1_compile", "zero2_compile"})
# plans from per-node memory peaks, which only mean something once the state was evicted before profiling
CONTRACT = PassContract(requires=frozenset({CAP_OPT_STATES_EVICTED}), conflicts_with=_INCOMPATIBLE)
# offloads everything at the first graph's head and reloads at the last graph's tail: no profile needed,
# and it takes the place of the planned variant
CONTRACT_SYNC = PassContract(conflicts_with=_INCOMPATIBLE | {NAME})
CONTRACT_FOR_INIT = PassContract(provides=frozenset({CAP_OPT_STATES_EVICTED}), conflicts_with=_INCOMPATIBLE)
