"""DeepCompile's parameter-offload pass: its name and contract."""
from .contract import CAP_Z3_GATHER_RELEASE, PassContract

NAME = "offload_parameters"
# rewrites the all-gathers zero3_compile inserted
CONTRACT = PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}))
