"""DeepSpeed's DeepCompile engine state, for ``deepspeed.runtime.engine.DeepSpeedEngine``: the process-wide
Dynamo settings and compiled-backward capture state an engine owns while DeepCompile is active, given back
when it is deactivated or destroyed (other engines' state stays)."""
from __future__ import annotations


class DeepCompileEngineState:
    """Mixed into ``DeepSpeedEngine`` ahead of shardwise's engine. Reads ``_deepcompile_active``,
    ``_deepcompile_owned_frames`` (frame keys whose compiled-backward inputs this engine captures) and
    ``_deepcompile_dynamo_config_restore`` (the callback from ``init_z3``'s Dynamo settings)."""

    def is_deepcompile_active(self) -> bool:
        return getattr(self, "_deepcompile_active", False)

    def _release_deepcompile_compiled_backward_state(self) -> None:
        owned = getattr(self, "_deepcompile_owned_frames", None)
        if owned:
            from deepspeed.compile.backend import cleanup_compiled_backward_state

            cleanup_compiled_backward_state(owned_frames=owned)

    def _release_deepcompile_dynamo_config(self) -> None:
        restore = getattr(self, "_deepcompile_dynamo_config_restore", None)
        if restore is not None:
            restore()
            del self._deepcompile_dynamo_config_restore

    def _set_deepcompile_active(self, active: bool) -> None:
        """Turn DeepCompile on or off for this engine; turning it off gives back the state it owns and
        puts back the module forward hooks DeepCompile replaced."""
        if not active:
            self._release_deepcompile_compiled_backward_state()
            self._release_deepcompile_dynamo_config()
        if getattr(self, "_deepcompile_active", False) == active:
            return
        if active:
            for name in ("module_forward_pre_hook", "module_forward_post_hook"):
                hook = getattr(self, name, None)
                if hook is not None:
                    hook.remove()
                    setattr(self, name, None)
        else:
            for name, make in (("module_forward_pre_hook", "_create_module_forward_pre_hook"),
                               ("module_forward_post_hook", "_create_module_forward_post_hook")):
                if getattr(self, name, None) is None and hasattr(self, make):
                    setattr(self, name, getattr(self, make)())
        self._deepcompile_active = active

    def destroy(self) -> None:
        """Give back this engine's DeepCompile state, then destroy the engine."""
        self._release_deepcompile_compiled_backward_state()
        self._release_deepcompile_dynamo_config()
        super().destroy()
