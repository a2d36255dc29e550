"""``deepspeed.runtime.zenflow``: ZenFlow's config block (``zero_optimization.zenflow``) parses as DeepSpeed
parses it (``zenflow_config.ZenFlowConfig``); ZenFlow itself (stall-free offload) is not implemented, so an
engine built from a config that switches it on refuses with a named error."""
