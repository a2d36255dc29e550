"""DeepCompile's ZeRO-1/2 gradient-reduce passes: their names and contracts. The passes themselves
rewrite graphs with DeepSpeed's compiled ``dc`` ops, which shardwise does not have."""
from .contract import PassContract

NAME_Z1 = "zero1_compile"
NAME_Z2 = "zero2_compile"
# ZeRO-1/2 reduce the gradients themselves: they never share a schedule with the ZeRO-3 rewrite
CONTRACT_Z1 = PassContract(conflicts_with=frozenset({"zero3_compile"}))
CONTRACT_Z2 = PassContract(conflicts_with=frozenset({"zero3_compile", NAME_Z1}))
