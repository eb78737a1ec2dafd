"""dejavu-compile: Deja Vu contextual sparsity for LLM decoding, as a torch.compile backend.

    plan = dejavu_compile.calibrate(model, tokenizer)
    model.forward = torch.compile(model.forward, backend="dejavu", options={"plan": plan})
"""
from dejavu_compile.backend import dejavu_backend
from dejavu_compile.blocks import AttentionBlock, MLPBlock, WeightRef
from dejavu_compile.explain import ExplainReport, explain
from dejavu_compile.rules import register_rule, registered_rules, unregister_rule

__version__ = "0.1.0"
__all__ = [
    "AttentionBlock", "ExplainReport", "MLPBlock", "SparsityPlan", "WeightRef", "calibrate",
    "dejavu_backend", "explain", "prepare_model", "register_rule", "registered_rules", "unregister_rule",
]


def __getattr__(name):  # heavier pieces load on first use
    if name == "SparsityPlan":
        from dejavu_compile.plan import SparsityPlan

        return SparsityPlan
    if name == "calibrate":
        from dejavu_compile.calibrate import calibrate

        return calibrate
    if name == "prepare_model":
        from dejavu_compile.passes.sparsify import prepare_model

        return prepare_model
    raise AttributeError(f"module 'dejavu_compile' has no attribute {name!r}")
