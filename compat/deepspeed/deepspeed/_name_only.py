"""Classes of DeepSpeed that shardwise has no counterpart for, importable by name (so ``isinstance`` checks and
imports in scripts work) and refusing, with the reason, when built."""


def name_only(path: str, name: str, reason: str) -> type:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{path}.{name} is not provided by shardwise: {reason}. See docs/deepspeed-compat.md")

    return type(name, (), {"__init__": __init__, "__module__": path, "__doc__": f"Name only: {reason}."})
