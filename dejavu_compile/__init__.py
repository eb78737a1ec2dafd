"""dejavu-compile: Deja Vu contextual sparsity for LLM decoding, as a torch.compile backend.

    model = torch.compile(model, backend="dejavu", options={"plan": plan})
"""
from dejavu_compile.backend import dejavu_backend
from dejavu_compile.blocks import AttentionBlock, MLPBlock, WeightRef
from dejavu_compile.explain import ExplainReport, explain
from dejavu_compile.rules import register_rule, registered_rules, unregister_rule

__version__ = "0.1.0"
__all__ = [
    "AttentionBlock", "ExplainReport", "MLPBlock", "WeightRef", "dejavu_backend", "explain",
    "register_rule", "registered_rules", "unregister_rule",
]
