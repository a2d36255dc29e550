"""``deepspeed.utils.comms_logging``: DeepSpeed's ``CommsLogger`` record layout, for code that reads or fills
it directly: ``comms_dict = {op name: {message bytes: [count, [latency ms], [algbw Gbps], [busbw Gbps]]}}``,
index ``i`` of the three lists being the ``i``-th recorded op.

shardwise's collectives record into ``shardwise.comm.logger.CommsLogger`` (the ``comms_logger`` config
block, ``deepspeed.comm.log_summary()``), not into this class.
"""
from __future__ import annotations

from shardwise import comm
from shardwise.comm.logger import ALIASES, bus_factor
from shardwise.comm.ops import human_bytes
from shardwise.utils.logging import log_dist

from .timer import trim_mean

__all__ = ["CommsLogger", "calc_bw_log", "convert_size"]

# ops whose message size is one rank's part of the gathered or scattered buffer
_PER_RANK_SIZE = {"all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor"}


def convert_size(size_bytes: int) -> str:
    return "0B" if size_bytes == 0 else human_bytes(size_bytes)


def calc_bw_log(comm_op: str, size: int, duration: float) -> tuple[float, float]:
    """(algorithmic, bus) bandwidth in Gbps of ``size`` bytes moved by ``comm_op`` in ``duration`` ms, over
    the world: all_reduce moves the buffer twice, all_gather / reduce_scatter the whole gathered buffer."""
    n = comm.get_world_size() if comm.is_initialized() else 1
    if comm_op in _PER_RANK_SIZE:
        size *= n
    algbw = size * (2 if comm_op in ("all_reduce", "all_reduce_coalesced", "inference_all_reduce") else 1) / duration
    busbw = size / duration * bus_factor(ALIASES.get(comm_op, comm_op).removesuffix("_coalesced"), n)
    return algbw * 8 / 1e6, busbw * 8 / 1e6


class CommsLogger:
    def __init__(self) -> None:
        self.comms_dict: dict = {}
        self.verbose = self.debug = False
        self.prof_ops: list[str] = []
        self.prof_all = True
        self.enabled = False

    def configure(self, comms_config) -> None:
        """From a config's ``comms_logger`` block (shardwise's model or DeepSpeed's)."""
        block = getattr(comms_config, "comms_logger", comms_config)
        self.enabled = bool(getattr(comms_config, "comms_logger_enabled", getattr(block, "enabled", False)))
        if self.enabled:
            self.verbose, self.debug = block.verbose, block.debug
            self.prof_ops, self.prof_all = list(block.prof_ops), block.prof_all

    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list) -> None:
        self.prof_ops = sorted(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def append(self, raw_name: str, record_name: str, latency: float, msg_size: int) -> None:
        algbw, busbw = calc_bw_log(raw_name, msg_size, latency)
        entry = self.comms_dict.setdefault(record_name, {}).setdefault(msg_size, [0, [], [], []])
        entry[0] += 1
        for values, value in zip(entry[1:], (latency, algbw, busbw)):
            values.append(value)
        if self.verbose:
            log_dist(f"comm op: {record_name} | time (ms): {latency:.2f} | msg size: {convert_size(msg_size)} | "
                     f"algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}", [0])

    def get_raw_data(self) -> dict:
        return self.comms_dict.copy()

    def has_data(self) -> bool:
        return bool(self.comms_dict)

    def reset_data(self) -> None:
        self.comms_dict.clear()

    def get_operation_names(self) -> list[str]:
        return list(self.comms_dict)

    def get_total_operations(self) -> int:
        return sum(entry[0] for sizes in self.comms_dict.values() for entry in sizes.values())

    def get_operation_summary(self, operation_name: str) -> dict | None:
        """{message bytes: count, total and mean latency (ms), mean bandwidths (Gbps)}; means leave out the
        10% fastest and slowest. None for an op never recorded."""
        if operation_name not in self.comms_dict:
            return None
        out = {}
        for size, (count, latencies, algbws, busbws) in self.comms_dict[operation_name].items():
            out[size] = {"count": count, "total_latency_ms": sum(latencies),
                         "avg_latency_ms": trim_mean(latencies, 0.1), "tput_avg_gbps": trim_mean(algbws, 0.1),
                         "busbw_avg_gbps": trim_mean(busbws, 0.1), "msg_size_bytes": size,
                         "msg_size_str": convert_size(size)}
        return out
