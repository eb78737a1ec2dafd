"""The public rule registry: built-in and user pattern rules go through one list.

A rule is any object with a ``name``, a ``kind`` ("mlp" or "attention") and a method
``match(ctx) -> iterable of blocks``, where ``ctx`` is a :class:`dejavu_compile.compiler.passes.match.MatchContext`.
Rules run from the highest priority down; a projection claimed by one rule is not offered to the
next, so a user rule registered with a higher priority than the built-ins (user default: 100,
built-ins: 0) takes precedence.

The usual way to teach the matcher a new MLP is to give the element-wise MLP rule another
activation; it checks the traced activation numerically against the function you pass::

    import torch, dejavu_compile
    from dejavu_compile.compiler.passes.match_mlp import MLPRule

    dejavu_compile.register_rule(MLPRule("squared_relu", {"relu2": lambda x: torch.relu(x) ** 2}))
"""
from __future__ import annotations

import itertools
from typing import Protocol, runtime_checkable

USER_PRIORITY = 100
BUILTIN_PRIORITY = 0


@runtime_checkable
class Rule(Protocol):
    name: str
    kind: str

    def match(self, ctx): ...


_registry: dict[str, tuple[int, int, Rule]] = {}
_order = itertools.count()


def register_rule(rule: Rule, *, priority: int = USER_PRIORITY, replace: bool = False) -> Rule:
    """Add ``rule`` to the registry (returns it, so it can decorate a class instance factory)."""
    if not isinstance(rule, Rule) or rule.kind not in ("mlp", "attention"):
        raise TypeError("a rule needs .name, .kind in {'mlp', 'attention'} and .match(ctx)")
    if rule.name in _registry and not replace:
        raise ValueError(f"a rule named {rule.name!r} is already registered (pass replace=True)")
    _registry[rule.name] = (priority, next(_order), rule)
    return rule


def unregister_rule(name: str) -> None:
    if name not in _registry:
        raise KeyError(f"no rule named {name!r}; registered: {sorted(_registry)}")
    del _registry[name]


def registered_rules() -> list[Rule]:
    """Rules in the order they run: priority high to low, then registration order."""
    _ensure_builtins()
    return [rule for _, _, rule in sorted(_registry.values(), key=lambda t: (-t[0], t[1]))]


_builtins_loaded = False


def _ensure_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    from dejavu_compile.compiler.passes.match_attention import AttentionRule
    from dejavu_compile.compiler.passes.match_mlp import MLPRule

    for rule in (MLPRule(), AttentionRule()):
        if rule.name not in _registry:
            register_rule(rule, priority=BUILTIN_PRIORITY)
