"""DeepCompile's ZeRO-3 gather/release pass: its name and contract (the rewrite itself needs DeepSpeed's
compiled ``dc`` ops, which shardwise does not have)."""
from .contract import CAP_Z3_GATHER_RELEASE, PassContract

NAME = "zero3_compile"
# puts the all-gather / release ops into the graph that the later ZeRO-3 passes rearrange
CONTRACT = PassContract(provides=frozenset({CAP_Z3_GATHER_RELEASE}))
