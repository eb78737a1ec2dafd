"""dejavu-compile: Deja Vu contextual sparsity for LLM decoding, as a torch.compile backend.

    plan = dejavu_compile.calibrate(model, tokenizer)
    model.forward = torch.compile(model.forward, backend="dejavu", options={"plan": plan})
"""
from dejavu_compile.compiler.backend import dejavu_backend
from dejavu_compile.compiler.blocks import AttentionBlock, MLPBlock, WeightRef
from dejavu_compile.compiler.explain import ExplainReport, explain
from dejavu_compile.compiler.rules import register_rule, registered_rules, unregister_rule
from dejavu_compile.errors import DejavuOptionError, PlanMismatchError

__version__ = "0.1.0"
__all__ = [
    "AttentionBlock", "DejavuOptionError", "ExplainReport", "PlanMismatchError", "MLPBlock", "SparsityPlan",
    "WeightRef", "calibrate", "dejavu_backend", "explain", "greedy_decode", "prepare_model", "quantize_weights",
    "register_rule", "registered_rules", "unregister_rule",
]


def __getattr__(name):  # heavier pieces load on first use
    if name == "SparsityPlan":
        from dejavu_compile.plan.sparsity_plan import SparsityPlan

        return SparsityPlan
    if name == "calibrate":
        from dejavu_compile.calibration.calibrate import calibrate

        return calibrate
    if name == "greedy_decode":
        from dejavu_compile.evaluation.decode import greedy_decode

        return greedy_decode
    if name == "prepare_model":
        from dejavu_compile.compiler.prepare import prepare_model

        return prepare_model
    if name == "quantize_weights":
        from dejavu_compile.compiler.quantize import quantize_weights

        return quantize_weights
    raise AttributeError(f"module 'dejavu_compile' has no attribute {name!r}")
