"""The comms logger (``comms_logger`` config block): counts, sizes, latency and bandwidth.

Bandwidths follow the nccl-tests definitions. For a message of S bytes that took t
seconds on a group of n ranks, the algorithmic bandwidth is S / t. The bus bandwidth
scales it by what each rank's link really carries: 2(n-1)/n for all_reduce, (n-1)/n for
all_gather and reduce_scatter (S is the whole gathered or scattered buffer), 1 for
broadcast, 0 for barrier.

Besides the table, the logger counts bytes per process group (``group_bytes()``) and, for a given node
size, the bytes that cross node boundaries (``cross_node_bytes(node_size)``; a rank's node is
``rank // node_size``). Both count what this rank receives, as if each collective were a direct exchange
between the ranks of its group: for a message of S bytes on n ranks, S/n from each peer for an all-gather,
a reduce-scatter and an all-to-all (equal splits), 2S/n from each peer for an all-reduce, S for a
broadcast (from its source, assumed off-node when any peer is); point-to-point ops count S.
Summed over the ranks this is the traffic over the links between nodes, whatever algorithm the backend
runs (a ring moves the same bytes per rank across a node boundary at most once per hop).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from shardwise.comm.ops import OpRecord, human_bytes

log = logging.getLogger("shardwise")

# Our op names, and the DeepSpeed names accepted for them in ``prof_ops``.
OP_NAMES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
            "barrier", "broadcast_object", "compressed_all_to_all", "compressed_all_gather")
ALIASES = {"all_gather_base": "all_gather_into_tensor", "all_gather": "all_gather_into_tensor",
           "reduce_scatter_base": "reduce_scatter_tensor", "reduce_scatter": "reduce_scatter_tensor",
           "broadcast_object_list": "broadcast_object"}


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor", "compressed_all_to_all", "compressed_all_gather"):
        return (n - 1) / n
    if op == "barrier":
        return 0.0
    return 1.0


@dataclass
class _Stats:
    count: int = 0
    total_latency: float = 0.0  # seconds
    algbw_sum: float = 0.0  # bytes/s, summed over ops for the average
    busbw_sum: float = 0.0


class CommsLogger:
    def __init__(self, *, verbose: bool = False, prof_all: bool = True,
                 prof_ops: list[str] | tuple[str, ...] = (), debug: bool = False,
                 rank: int = 0) -> None:
        unknown = [o for o in prof_ops if o not in OP_NAMES and o not in ALIASES]
        if unknown:
            raise ValueError(f"comms_logger.prof_ops: unknown op(s) {unknown}; known ops are "
                             f"{list(OP_NAMES)} (DeepSpeed names {sorted(ALIASES)} also work)")
        self.verbose, self.prof_all, self.debug = verbose, prof_all, debug
        self.prof_ops = {ALIASES.get(o, o) for o in prof_ops}
        self.rank = rank
        self.data: dict[str, dict[int, _Stats]] = {}
        self.traffic: dict[tuple[str, int, str, int], int] = {}  # (group, group size, op, bytes) -> count

    def wants(self, op: str) -> bool:
        return self.prof_all or op in self.prof_ops

    def record(self, rec: OpRecord) -> None:
        latency = max((rec.end or rec.start) - rec.start, 1e-9)
        algbw = rec.nbytes / latency
        busbw = algbw * bus_factor(rec.name, rec.group_size)
        name = rec.name + (f" | [Caller Func: {rec.caller}]" if rec.caller else "")
        key = (rec.group, rec.group_size, rec.name, rec.nbytes)
        self.traffic[key] = self.traffic.get(key, 0) + 1
        stats = self.data.setdefault(name, {}).setdefault(rec.nbytes, _Stats())
        stats.count += 1
        stats.total_latency += latency
        stats.algbw_sum += algbw
        stats.busbw_sum += busbw
        if self.verbose and self.rank == 0:
            log.info("rank=%d | comm op: %s #%d on %s | time (ms): %.3f | msg size: %s | "
                     "algbw (GB/s): %.3f | busbw (GB/s): %.3f", self.rank, name, rec.seq,
                     rec.group, latency * 1e3, human_bytes(rec.nbytes), algbw / 1e9, busbw / 1e9)

    def summary(self) -> dict[str, dict[int, dict[str, float]]]:
        """{op: {message bytes: {count, total_latency_ms, avg_latency_ms, algbw_gbps, busbw_gbps}}}.

        Bandwidths are averages over the ops, in GB/s (1e9 bytes per second).
        """
        out: dict[str, dict[int, dict[str, float]]] = {}
        for name, sizes in self.data.items():
            for size, s in sorted(sizes.items()):
                out.setdefault(name, {})[size] = {
                    "count": s.count,
                    "total_latency_ms": s.total_latency * 1e3,
                    "avg_latency_ms": s.total_latency * 1e3 / s.count,
                    "algbw_gbps": s.algbw_sum / s.count / 1e9,
                    "busbw_gbps": s.busbw_sum / s.count / 1e9,
                }
        return out

    def reset(self) -> None:
        self.data.clear()
        self.traffic.clear()

    def group_bytes(self) -> dict[str, int]:
        """{group ("world", "ranks [0-1]"): bytes of the messages of the ops on it} (the table's message
        sizes, summed)."""
        out: dict[str, int] = {}
        for (group, _, _, nbytes), count in self.traffic.items():
            out[group] = out.get(group, 0) + nbytes * count
        return out

    def cross_node_bytes(self, node_size: int, *, by_group: bool = False):
        """Bytes this rank received from ranks on other nodes (nodes of ``node_size`` ranks; see the module
        docstring), in total or ``{group: bytes}``."""
        out: dict[str, int] = {}
        me = self.rank // node_size
        for (group, size, op, nbytes), count in self.traffic.items():
            ranks = group_ranks(group, size)
            off = sum(1 for r in ranks if r // node_size != me)
            out[group] = out.get(group, 0) + count * _received_off_node(op, nbytes, size, off)
        return out if by_group else sum(out.values())


def format_table(summary: dict, *, straggler: dict | None = None) -> str:
    """DeepSpeed's log_summary layout: one block per op, one row per message size."""
    cols = ["Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "algbw (GB/s)",
            "busbw (GB/s)"]
    if straggler is not None:
        cols.append("Straggler(ms)")
    widths = [14, 8, 19, 17, 14, 14, 14]
    head = "Comm. Op".ljust(22) + "".join(c.ljust(w) for c, w in zip(cols, widths))
    lines = [head]
    for name in sorted(summary):
        lines.append(name)
        for size, s in summary[name].items():
            row = [human_bytes(size), str(s["count"]), f"{s['total_latency_ms']:.2f}",
                   f"{s['avg_latency_ms']:.3f}", f"{s['algbw_gbps']:.3f}", f"{s['busbw_gbps']:.3f}"]
            if straggler is not None:
                row.append(f"{straggler.get((name, size), 0.0):.2f}")
            lines.append(" " * 22 + "".join(v.ljust(w) for v, w in zip(row, widths)))
    return "\n".join(lines)


def _received_off_node(op: str, nbytes: int, size: int, off: int) -> int:
    if off == 0 or size <= 1:
        return 0
    if op == "all_reduce":
        return 2 * nbytes * off // size
    if op in ("broadcast", "broadcast_object", "send", "recv", "isend", "irecv"):
        return nbytes
    if op == "barrier":
        return 0
    return nbytes * off // size  # all-gather, reduce-scatter, all-to-all: S/n per peer


def group_ranks(group: str, size: int) -> list[int]:
    """The global ranks of a group as ``ops.describe_group`` names it ("world", "ranks [0,2-3]")."""
    if group == "world":
        return list(range(size))
    out = []
    for part in re.findall(r"\d+(?:-\d+)?", group):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out
