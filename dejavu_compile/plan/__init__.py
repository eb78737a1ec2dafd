"""Sparsity plans: per-layer predictors and k, and the predictor kinds they hold."""
from dejavu_compile.plan.sparsity_plan import PlanEntry, SparsityPlan

__all__ = ["PlanEntry", "SparsityPlan"]
