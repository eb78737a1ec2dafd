"""Masked dense simulation of a plan: the same predictors and top-k, applied as 0/1 masks on
dense blocks (exact per token, any number of tokens: quality evaluation in one prefill pass).
Each sparse feature keeps its simulation beside its lowering, so the two cannot drift apart:
``sparse_mlp.simulate_mlp``, ``sparse_attention.simulate_attention``, ``head_screen.simulate_head``."""
from __future__ import annotations

import torch.fx as fx

from dejavu_compile.compiler.passes.graph_build import placeholder_values
from dejavu_compile.compiler.passes.head_screen import simulate_head
from dejavu_compile.compiler.passes.sparse_attention import simulate_attention
from dejavu_compile.compiler.passes.sparse_mlp import simulate_mlp


def simulate_plan(gm, match, plan, report, example_inputs, opts) -> fx.GraphModule:
    """Masked dense simulation: the same predictors and top-k, applied as a 0/1 mask on the
    activations before the dense down projection (on the attention output for heads). Exact per
    token, any number of tokens (so it evaluates perplexity in one prefill pass); reads every
    weight, so it is not faster."""
    values = placeholder_values(gm, example_inputs)
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    ordered = sorted(match.blocks, key=lambda b: order.get(b.nodes.input, -1))
    for block in match.mlp:
        entry = plan.entries.get((block.layer, "mlp"))
        if entry is not None and not entry.dense:
            simulate_mlp(gm, graph, block, entry, plan, ordered, values, report, match.fallbacks, opts)
    for block in match.attention:
        entry = plan.entries.get((block.layer, "attention"))
        if entry is not None and not entry.dense:
            simulate_attention(gm, graph, block, entry, ordered, values, report)
    simulate_head(gm, plan.head_candidates, values, report)
    graph.lint()
    gm.recompile()
    return gm


class SimulationPass:
    """The plan as masks on dense blocks (option ``simulate``), in place of the sparse lowerings."""

    name = "simulate"

    def __call__(self, gm, ctx):
        before = len(ctx.report.rewritten)
        gm = simulate_plan(gm, ctx.match, ctx.plan, ctx.report, ctx.example_inputs, ctx.opts)
        ctx.count(self.name, len(ctx.report.rewritten) - before)
        return gm
