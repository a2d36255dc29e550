"""The ``compile`` block: DeepSpeed's keys (which configure DeepCompile) and shardwise's own three.

shardwise compiles with ``torch.compile`` (``engine.compile()``, ``runtime/compile.py``); DeepCompile,
DeepSpeed's compiler passes that move ZeRO into the graph, is not implemented. Its keys are accepted
at their defaults and refused, with that reason, when set to anything else.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from .base import ConfigModel, Int

__all__ = ["CompileConfig"]


class CompileConfig(ConfigModel):
    # DeepSpeed's keys: all of them DeepCompile's (or AutoEP's) knobs
    deepcompile: bool = False
    autoep_non_moe: bool = False
    free_activation: bool = False
    free_activation_threshold: Int = 10 * 1024 * 1024
    offload_activation: bool = False
    offload_activation_pin_memory: bool = True
    offload_opt_states: bool = False
    double_buffer: bool = True
    symmetric_memory: bool = False
    debug_log: bool = False
    offload_parameters: bool = False
    sync_before_reduce: bool = False
    sync_after_reduce: bool = False
    sync_before_allgather: bool = False
    sync_after_allgather: bool = False
    keep_int_input_tensors: bool = True
    keep_all_input_tensors: bool = False
    passes: list[str] | None = None
    # ours: compile at initialize, as engine.compile(backend=backend, compile_kwargs=kwargs) would
    enabled: bool = False
    backend: str | None = None  # None: the accelerator's compile backend (inductor)
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _refuse_deepcompile(self) -> "CompileConfig":
        ours = {"enabled", "backend", "kwargs"}
        changed = [k for k, f in type(self).model_fields.items()
                   if k not in ours and getattr(self, k) != f.get_default(call_default_factory=True)]
        if changed:
            why = ("configure DeepCompile (DeepSpeed's compiler passes for ZeRO), which shardwise does not "
                   "implement; engine.compile() (or compile.enabled) compiles each block with torch.compile and "
                   "keeps ZeRO outside the graphs (docs/compile.md): remove them")
            if changed == ["autoep_non_moe"]:
                why = "compiles around AutoEP (mixture-of-experts) layers, which shardwise does not implement"
            raise PydanticCustomError("shardwise_unsupported", "{keys} {why}",
                                      {"keys": ", ".join(f"compile.{k}" for k in changed), "why": why})
        return self
