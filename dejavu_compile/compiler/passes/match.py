"""Run the registered rules over a traced graph; collect block records and what stayed dense."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch.fx as fx

from dejavu_compile.compiler.blocks import AttentionBlock, Block, MLPBlock, WeightRef
from dejavu_compile.compiler.passes.graph_utils import LinearCall, find_linears, is_op, layer_index, to_networkx


@dataclass
class MatchResult:
    blocks: list[Block] = field(default_factory=list)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    layers: set[int] = field(default_factory=set)  # decoder layers that own projections
    # quantize_weights' projections (dejavu::cpu_q8_linear calls): no rule matches them, so no plan reaches them
    int8_projections: int = 0

    @property
    def mlp(self) -> list[MLPBlock]:
        return [b for b in self.blocks if isinstance(b, MLPBlock)]

    @property
    def attention(self) -> list[AttentionBlock]:
        return [b for b in self.blocks if isinstance(b, AttentionBlock)]


class MatchContext:
    """What a rule sees: the graph, its projections, and the claims and fallbacks made so far."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.linears: dict[fx.Node, LinearCall] = find_linears(gm)
        self._claims: dict[fx.Node, Block] = {}
        self._claimed_nodes: set[fx.Node] = set()
        self._fallbacks: dict[fx.Node, tuple[str, str]] = {}

    @cached_property
    def graph(self):
        return to_networkx(self.gm)

    def is_claimed(self, node: fx.Node) -> bool:
        return node in self._claimed_nodes

    def claim(self, key: fx.Node, block: Block, nodes=()) -> None:
        self._claims[key] = block
        self._claimed_nodes.update([key, *nodes])

    def fallback(self, key: fx.Node, where: str, reason: str) -> None:
        """Record that the region at ``key`` stays dense and why; returns None for rules to return."""
        self._fallbacks.setdefault(key, (where, reason))
        return None

    def weight_ref(self, lin: LinearCall, rows) -> WeightRef:
        return WeightRef(name=lin.weight_name, layout=lin.layout, rows=rows, bias=lin.bias_name,
                         node=lin.weight, bias_node=lin.bias)

    @staticmethod
    def see_through(node: fx.Node) -> fx.Node:
        """The same values under another dtype or memory layout count as the same input."""
        while is_op(node, methods={"to", "contiguous", "float"}) and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        return node


def match_blocks(gm: fx.GraphModule, rules=None) -> MatchResult:
    """Apply ``rules`` (default: the registry, highest priority first) to ``gm``."""
    from dejavu_compile.compiler.rules import registered_rules

    ctx = MatchContext(gm)
    result = MatchResult()
    for rule in rules if rules is not None else registered_rules():
        for block in rule.match(ctx):
            result.blocks.append(block)
    for key, entry in ctx._fallbacks.items():
        if key not in ctx._claimed_nodes:
            result.fallbacks.append(entry)
    for lin in ctx.linears.values():
        layer = layer_index(lin.weight_name)
        if layer is not None:
            result.layers.add(layer)
    result.blocks.sort(key=lambda b: (b.layer, b.kind != "attention"))
    token_counts = {b.tokens for b in result.attention}
    for block in result.mlp:
        if block.tokens == 0:  # flattened input (OPT): rows = batch * tokens
            if len(token_counts) == 1:
                block.tokens = next(iter(token_counts))
                block.batch //= max(block.tokens, 1)
            else:
                block.tokens = block.batch
                block.batch = 1
            block.decode = block.tokens == 1
    # Layers that own projections but where a block kind went unmatched: say so.
    for kind, found in (("attention", result.attention), ("mlp", result.mlp)):
        have = {b.layer for b in found}
        if result.layers:
            for layer in sorted(result.layers - have):
                result.fallbacks.append((f"layer {layer}", f"no {kind} block matched in this layer"))
    result.int8_projections = sum(1 for n in gm.graph.nodes
                                  if n.op == "call_function" and "cpu_q8_linear" in str(n.target))
    if result.int8_projections:  # quantize_weights' projections are no linears to the rules: say why they stay dense
        result.fallbacks.append(("int8 projections", int8_reason(result.int8_projections)))
    return result


def int8_reason(count: int) -> str:
    """Why a graph's int8 projections stay dense (the fallback reported, and the warning under a plan)."""
    return (f"{count} projections with int8 weights (quantize_weights): sparse plans do not reach them yet, "
            "they compile dense")


class MatchPass:
    """Records the matched blocks on the report (``report.match``); the graph is not changed."""

    name = "match"

    def __call__(self, gm: fx.GraphModule, ctx) -> fx.GraphModule:
        ctx.report.match = match_blocks(gm)
        ctx.count(self.name, len(ctx.report.match.blocks))
        return gm
