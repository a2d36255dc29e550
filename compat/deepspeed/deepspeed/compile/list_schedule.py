"""DeepCompile's node schedulers over ``torch.fx`` graphs with ZeRO-3 all-gather / release nodes
(``deepspeed.compile.list_schedule``).

:func:`fast_free_schedule` orders a graph so each gathered parameter is freed soon after it is gathered:
it repeatedly picks the next ``dc.allgather_param`` to issue and schedules what it needs, preferring an
all-gather whose parameter can be released without gathering any other parameter first (among those:
fewest all-gathers on the way, then least gathered memory before it, then least compute until the
release), else the one that forces the least extra gathered memory before its release. Gradient
reduces and graph outputs are placed as soon as every all-gather they depend on is scheduled.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List

import torch
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from .fx import get_output_node
from .util import get_last_uses, is_release_node


def make_graph_from_schedule(scheduled: List[Node]) -> Graph:
    """A new graph holding copies of ``scheduled``'s nodes in that order."""
    new_graph = Graph()
    copies: Dict[str, Node] = {}
    for node in scheduled:
        copies[node.name] = new_graph.node_copy(node, lambda n: copies[n.name])
    return new_graph


def create_mem_table(graph: Graph) -> Dict[str, int]:
    """Node name -> memory it adds (an all-gather: its tensor size) or frees (a release or reduce: minus
    its tensor size); 0 for other nodes."""
    table = {}
    for node in graph.nodes:
        if node.name.startswith("allgather_ds_param"):
            table[node.name] = node.meta["tensor_size"]
        elif node.name.startswith(("release_ds_param", "reduce_ds_param")):
            table[node.name] = -node.meta["tensor_size"]
        else:
            table[node.name] = 0
    return table


def init_schedule_with_placeholders(graph: Graph):
    """The starting state: placeholders scheduled, everything else not; returns ``(scheduled,
    unscheduled, edges, mem_table, remaining_users, user_to_producer)``."""
    remaining_users = defaultdict(set)
    user_to_producer = {}
    scheduled, unscheduled = [], []
    for node in graph.nodes:
        if node.op == "placeholder":
            scheduled.append(node)
            remaining_users[node] = set(node.users)
            for user in node.users:
                user_to_producer[user] = node
        else:
            unscheduled.append(node)
    return scheduled, unscheduled, defaultdict(list), create_mem_table(graph), remaining_users, user_to_producer


def get_node_requirements(target_node: Node, scheduled: List[Node]) -> List[Node]:
    """The not-yet-scheduled nodes ``target_node`` depends on, ``target_node`` last, each after its
    own inputs (a depth-first post-order over node arguments)."""
    done = set(scheduled)
    seen = set()
    order: List[Node] = []
    stack = [(target_node, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in done or node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        args: List[Node] = []
        map_arg(node.args, args.append)
        for arg in reversed(args):  # so the first argument is visited first
            if arg not in done and arg not in seen:
                stack.append((arg, False))
    return order


@dataclass
class AllgatherTask:
    """One candidate all-gather: the compute before it (``allgather_cost``) and from it to its last use
    (``free_cost``), its size, the gathered memory scheduled before it (``allgather_acc_mem``) and between
    it and its release (``free_acc_mem``), the all-gathers up to its release, and the node lists up to
    the all-gather and up to the release."""
    node: Node
    allgather_cost: float
    free_cost: float
    allgathered_mem: int
    allgather_acc_mem: int
    free_acc_mem: int
    last_use: Node
    n_scheduled_ags: int
    schedule_until_ag: List[Node]
    schedule_until_free: List[Node]


def _free_path_allgather_key(task: AllgatherTask):
    return (task.n_scheduled_ags, task.allgather_acc_mem, task.free_cost, task.node.name)


def _fallback_allgather_key(task: AllgatherTask):
    return (task.free_acc_mem, task.n_scheduled_ags, task.allgather_acc_mem, task.free_cost, task.node.name)


def _is_allgather(node: Node) -> bool:
    return node.target == torch.ops.dc.allgather_param.default


def _gathers_needed(node: Node, scheduled: List[Node]) -> set:
    return {n for n in get_node_requirements(node, scheduled) if _is_allgather(n)}


def _make_task(ag: Node, scheduled: List[Node], node_to_last_use, releases) -> AllgatherTask:
    until_ag = get_node_requirements(ag, scheduled)
    last_use = node_to_last_use[ag]
    to_last_use = get_node_requirements(last_use, scheduled + until_ag)
    until_free = until_ag + to_last_use
    for release in releases[ag.args[2]]:
        for dep in get_node_requirements(release, scheduled + until_free):
            if dep not in until_free:
                until_free.append(dep)
    return AllgatherTask(node=ag,
                         allgather_cost=sum(n.meta["device_time"] for n in until_ag),
                         free_cost=sum(n.meta["device_time"] for n in to_last_use),
                         allgathered_mem=ag.meta["tensor_size"],
                         allgather_acc_mem=sum(n.meta["tensor_size"] for n in until_ag if _is_allgather(n)),
                         free_acc_mem=sum(n.meta["tensor_size"] for n in to_last_use if _is_allgather(n)),
                         last_use=last_use,
                         n_scheduled_ags=sum(1 for n in until_free if _is_allgather(n)),
                         schedule_until_ag=until_ag,
                         schedule_until_free=until_free)


def fast_free_schedule(graph: Graph, available_mem: int, output_size: int, debug_log: bool) -> Graph:
    """``graph``'s nodes reordered as the module docstring describes (nodes the profiler never reached
    get ``tensor_size`` 0); ``available_mem`` and ``output_size`` are accepted for DeepSpeed's
    signature and not used."""
    node_to_last_use, _ = get_last_uses(graph)
    for node in graph.nodes:
        node.meta.setdefault("tensor_size", 0)

    scheduled, unscheduled, *_ = init_schedule_with_placeholders(graph)
    pending_ags = [n for n in unscheduled if _is_allgather(n)]
    releases = defaultdict(list)
    for n in unscheduled:
        if is_release_node(n):
            releases[n.args[2]].append(n)

    # for each all-gather: the other all-gathers needed before its parameter's last use
    ags_before_free = {ag: _gathers_needed(node_to_last_use[ag], scheduled) for ag in pending_ags}
    # reduces and outputs, with the all-gathers each waits for
    waiting = [(n, _gathers_needed(n, scheduled)) for n in unscheduled if n.target == torch.ops.dc.reduce_grad.default]
    waiting += [(n, _gathers_needed(n, scheduled)) for n in get_output_node(graph).args[0]
                if isinstance(n, Node) and n.target != torch.ops.dc.reduce_grad.default]

    def schedule(nodes):
        for n in nodes:
            scheduled.append(n)
            unscheduled.remove(n)

    while pending_ags:
        # candidates: the pending all-gathers with the fewest others needed before their release
        fewest = min(len(ags_before_free[ag]) for ag in pending_ags)
        tasks = [_make_task(ag, scheduled, node_to_last_use, releases) for ag in pending_ags
                 if len(ags_before_free[ag]) == fewest]
        assert tasks, "No runnable allgather nodes"

        free_now = [t for t in tasks if t.free_acc_mem == 0]
        if free_now:
            chosen = min(free_now, key=_free_path_allgather_key)
            schedule(chosen.schedule_until_free)
        else:
            chosen = min(tasks, key=_fallback_allgather_key)
            schedule(chosen.schedule_until_ag)

        pending_ags.remove(chosen.node)
        del ags_before_free[chosen.node]
        for others in ags_before_free.values():
            others.discard(chosen.node)

        ready = []
        for node, ags in waiting:
            if chosen.node in ags:
                ags.discard(chosen.node)
                if not ags:
                    ready.append(node)
        for node in ready:
            schedule(get_node_requirements(node, scheduled))

    placed = set(scheduled)
    schedule([n for n in graph.nodes if n not in placed])
    assert not unscheduled, f"There are unscheduled nodes: {unscheduled}"

    new_graph = make_graph_from_schedule(scheduled)
    new_graph.lint()
    return new_graph
