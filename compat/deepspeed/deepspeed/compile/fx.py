"""DeepCompile's ``torch.fx`` graph-editing helpers (``deepspeed.compile.fx``); the ones that insert
DeepSpeed's compiled ``dc`` ops are not provided by shardwise."""
from torch.fx import Graph, Node


def get_output_node(graph: Graph) -> Node:
    """The graph's ``output`` node (``ValueError`` when it has none)."""
    for node in reversed(graph.nodes):
        if node.op == "output":
            return node
    raise ValueError("the graph has no output node")
