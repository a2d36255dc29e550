"""DeepCompile's selective-gather pass (keeps some gathered ZeRO-3 parameters resident): its name and
contract."""
from .contract import CAP_Z3_GATHER_RELEASE, PassContract

NAME = "selective_gather"
# picks which of zero3_compile's all-gathers stay resident
CONTRACT = PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}))

max_alloc_mem = 0
last_optimize_step = 0
MEM_MARGIN = 0.1
