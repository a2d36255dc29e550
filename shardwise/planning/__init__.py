"""Plan a run at cluster scale in one process: ``shardwise plan`` (docs/planning.md)."""

from shardwise.planning.plan import Plan, PlanError, RankPlan, fake_world, make_plan

__all__ = ["Plan", "PlanError", "RankPlan", "fake_world", "make_plan"]
