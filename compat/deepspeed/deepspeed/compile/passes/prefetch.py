"""DeepCompile's all-gather prefetch pass: its name and contract."""
from .contract import CAP_Z3_GATHER_RELEASE, PassContract

NAME = "prefetch"
# moves the all-gathers zero3_compile inserted
CONTRACT = PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}))

FUSE_FACTOR = 0.8
MARGIN = 0.1
MAX_FUSE_SIZE = 1e9
MAX_BUFFERED_SIZE = 4e9
