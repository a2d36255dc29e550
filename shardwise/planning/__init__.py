"""Plan a run at cluster scale in one process: ``shardwise plan`` (docs/planning.md)."""

__all__ = ["Plan", "PlanError", "RankPlan", "fake_world", "make_plan"]


def __getattr__(name: str):  # the plan (and torch.distributed's fake backend) only when asked for
    if name in __all__:
        from shardwise.planning import plan

        return getattr(plan, name)
    raise AttributeError(name)
