"""``deepspeed.ops.adagrad``: DeepSpeedCPUAdagrad."""

from .cpu_adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
