"""``deepspeed.autotuning.scheduler``: DeepSpeed's experiment scheduler's classes with their state
(``ResourceManager``'s nodes, slots and ``arg_mappings``, ``Node``, ``Reservation``). Running the
experiments is ``shardwise autotune``'s (``shardwise.autotuning``: it launches each trial with
``shardwise run`` and maps ``arg_mappings`` onto the script's flags as DeepSpeed does), so the methods that
would launch or collect experiments raise a named error."""
from __future__ import annotations

from shardwise.autotuning.runner import clean_arg_mappings

__all__ = ["Node", "Reservation", "ResourceManager"]

_USE = ("is not supported by shardwise: DeepSpeed's experiment scheduler does not run here; "
        "use `shardwise autotune` (or `shardwise run --autotuning tune`). See docs/deepspeed-compat.md")


class Node:
    """A host and its free slots (device indices)."""

    def __init__(self, host, max_slots):
        self.host = host
        self.max_slots = max_slots
        self.idle_slots = list(range(max_slots))

    def reserve_slots(self, slot_request: int) -> list | None:
        if len(self.idle_slots) >= slot_request:
            return [self.idle_slots.pop(0) for _ in range(slot_request)]
        return None

    def restore_slots(self, slots: list) -> None:
        self.idle_slots += slots


class Reservation:
    def __init__(self, node, slots):
        self.node = node
        self.slots = slots

    def restore_slots(self) -> None:
        self.node.restore_slots(self.slots)

    def desc(self) -> str:
        return f"{self.node.host}:{','.join(map(str, self.slots))}@"


class ResourceManager:
    """The scheduler's state: one ``Node`` per entry of ``hosts`` with ``num_gpus_per_node`` slots, the
    experiment queues, and ``arg_mappings`` (config key -> the script's flag, spaces stripped, the first
    spelling of a key kept)."""

    def __init__(self, args, hosts, num_gpus_per_node, results_dir, exps_dir, arg_mappings):
        self.results_dir = results_dir
        self.exps_dir = exps_dir
        self.num_gpus_per_node = num_gpus_per_node
        self.nodes = [Node(host, num_gpus_per_node) for host in hosts]
        self.experiment_queue = []
        self.running_experiments = {}
        self.finished_experiments = {}
        self.experiment_count = 0
        self.exp_paths = set()
        self.args = args
        self.arg_mappings = clean_arg_mappings(arg_mappings)

    def _refuse(self, method: str):
        raise NotImplementedError(f"deepspeed.autotuning.scheduler.ResourceManager.{method}() {_USE}")

    def schedule_experiments(self, exp_paths):
        self._refuse("schedule_experiments")

    def run_job(self, exp: dict, reservations):
        self._refuse("run_job")

    def experiment_check(self, pbar):
        self._refuse("experiment_check")

    def resource_request(self, exp):
        self._refuse("resource_request")

    def run(self):
        self._refuse("run")

    def parse_results(self, metric):
        self._refuse("parse_results")

    def save_exp_results_to_database(self, message, ranks=None, path=None):
        self._refuse("save_exp_results_to_database")

    def status(self) -> str:
        return "".join(f"{node.host} ({len(node.idle_slots)} idle gpus), " for node in self.nodes)[:-1]

    def clear(self) -> None:
        self.experiment_queue = []
        self.running_experiments = {}
        self.finished_experiments = {}
        self.exp_paths = set()
