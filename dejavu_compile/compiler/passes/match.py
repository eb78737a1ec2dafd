"""Run the registered rules over a traced graph; collect block records and what stayed dense."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch.fx as fx

from dejavu_compile.compiler.blocks import AttentionBlock, Block, MLPBlock, WeightRef
from dejavu_compile.compiler.passes.graph_utils import (
    LinearCall,
    find_linears,
    is_op,
    layer_index,
    param_name,
    to_networkx,
)


@dataclass
class MatchResult:
    blocks: list[Block] = field(default_factory=list)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    layers: set[int] = field(default_factory=set)  # decoder layers that own projections
    # quantize_weights' projections (dejavu::cpu_q8_linear calls) outside the int8 MLP blocks matched:
    # attention, output head, blocks mixing int8 and float projections; no plan reaches them
    int8_projections: int = 0
    int8_dense: set[tuple[int, str]] = field(default_factory=set)  # (layer, kind) of the blocks dropped for it

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
        self.linears: dict[fx.Node, LinearCall] = find_linears(gm, int8=True)
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
                         node=lin.weight, bias_node=lin.bias,
                         scales=None if lin.scales is None else param_name(lin.scales), scales_node=lin.scales)

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
    _keep_int8_mlp_blocks_only(result)
    in_blocks = {ref.node for b in result.blocks for ref in b.weights.values()}
    result.int8_projections = sum(1 for lin in ctx.linears.values() if lin.scales is not None
                                  and lin.weight not in in_blocks)
    if result.int8_projections:
        result.fallbacks.append(("int8 projections", int8_reason(result.int8_projections)))
    return result


def _keep_int8_mlp_blocks_only(result: MatchResult) -> None:
    """quantize_weights' int8 projections take a sparse path in gated MLPs only (``sparse_mlp``): an
    attention block of int8 projections, or a block mixing int8 and float ones, is dropped from the
    match and stays dense, reported."""
    kept = []
    for block in result.blocks:
        int8 = [ref.int8 for ref in block.weights.values()]
        if any(int8) and (not all(int8) or block.kind != "mlp"):
            what = "mixes int8 and float projections" if not all(int8) else "has int8 projections"
            result.fallbacks.append((block.module, f"{block.kind} block {what} (quantize_weights): no sparse "
                                                   "path for it, dense"))
            result.int8_dense.add((block.layer, block.kind))
            continue
        kept.append(block)
    result.blocks = kept


def int8_reason(count: int) -> str:
    """Why a graph's int8 projections outside its int8 MLP blocks stay dense (the fallback reported)."""
    return (f"{count} projections with int8 weights (quantize_weights) outside gated MLP blocks (attention, "
            "output head): sparse plans do not reach them, they compile dense")


class MatchPass:
    """Records the matched blocks on the report (``report.match``); the graph is not changed."""

    name = "match"

    def __call__(self, gm: fx.GraphModule, ctx) -> fx.GraphModule:
        ctx.report.match = match_blocks(gm)
        ctx.count(self.name, len(ctx.report.match.blocks))
        return gm
