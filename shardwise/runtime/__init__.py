from shardwise.runtime.dataloader import RepeatingLoader, build_dataloader
from shardwise.runtime.engine import Engine

__all__ = ["Engine", "RepeatingLoader", "build_dataloader"]
