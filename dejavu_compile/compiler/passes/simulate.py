"""Masked dense simulation of a plan: the same predictors and top-k, applied as 0/1 masks on
dense blocks (exact per token, any number of tokens: quality evaluation in one prefill pass), and
the output head's int8 screen (``head_screen.simulate_head``)."""
from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from dejavu_compile.compiler.blocks import AttentionBlock, MLPBlock
from dejavu_compile.compiler.passes.graph_build import add_constant, emit_size, placeholder_values, value_device
from dejavu_compile.compiler.passes.graph_utils import shape_of
from dejavu_compile.compiler.passes.head_screen import simulate_head
from dejavu_compile.compiler.passes.predictor_graph import emit_int8_selection
from dejavu_compile.compiler.passes.selection import insert_selection, takes_predictor_values
from dejavu_compile.compiler.passes.sparse_mlp import reads_down_copy, rounded_down_weight

log = logging.getLogger("dejavu_compile")


def simulate_plan(gm, match, plan, report, example_inputs, opts) -> fx.GraphModule:
    """Masked dense simulation: the same predictors and top-k, applied as a 0/1 mask on the
    activations before the dense down projection (on the attention output for heads). Exact per
    token, any number of tokens (so it evaluates perplexity in one prefill pass); reads every
    weight, so it is not faster."""
    values = placeholder_values(gm, example_inputs)
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    ordered = sorted(match.blocks, key=lambda b: order.get(b.nodes["input"], -1))
    for block in match.mlp:
        entry = plan.entries.get((block.layer, "mlp"))
        if entry is None or entry.dense:
            continue
        hidden = block.nodes["hidden"]
        from_predictor = takes_predictor_values(block, entry, match.fallbacks)
        if from_predictor:  # the predictor's own values, masked: what cpu_glu_int8_mlp sums
            x = block.nodes["input"]
            with graph.inserting_before(hidden.next):
                x2d = graph.call_method("reshape", (x, -1, shape_of(x)[-1]))
                estimate, idx = emit_int8_selection(gm, graph, block, entry, x2d, f"dejavu_L{block.layer}_mlp",
                                                     value_device(values, block.up.node))
        else:
            idx, _ = insert_selection(gm, graph, block, entry, ordered, values, opts)
        with graph.inserting_before(idx.next if from_predictor else hidden.next):  # after idx and hidden
            flat = graph.call_method("reshape", (hidden, -1, block.intermediate_size))
            kept = graph.call_method("type_as", (estimate, flat)) if from_predictor else flat
            zeros = graph.call_function(torch.zeros_like, (flat,))
            ones = graph.call_function(torch.ones_like, (idx,), {"dtype": _dtype_of(values, block)})
            mask = graph.call_function(torch.scatter, (zeros, -1, idx, ones))
            masked_flat = graph.call_function(operator.mul, (kept, mask))
            masked = graph.call_method("view_as", (masked_flat, hidden))
        hidden.replace_all_uses_with(masked, delete_user_cb=lambda user, ours=(flat, masked): user not in ours)
        copy_note = _round_down_rows(gm, graph, block, plan, values) if from_predictor else ""
        report.rewritten.append(f"layer {block.layer} mlp: masked simulation, {entry.k}/{entry.total} neurons"
                                f"{', values from the int8 predictor' if from_predictor else ''}{copy_note}")
    for block in match.attention:
        entry = plan.entries.get((block.layer, "attention"))
        if entry is not None and not entry.dense:
            simulate_attention(gm, graph, block, entry, ordered, values, report)
    simulate_head(gm, plan.head_candidates, values, report)
    graph.lint()
    gm.recompile()
    return gm


def _round_down_rows(gm, graph, block: MLPBlock, plan, values) -> str:
    """The plan's bf16 copy of the down rows, as the dense down projection's weight: what the decode
    op reads (CPU fp32 models, where the C++ op runs)."""
    weight = values.get(block.down.node)
    if not reads_down_copy(plan, weight):
        return ""
    rounded = add_constant(gm, graph, f"dejavu_L{block.layer}_down_{plan.down_rows}",
                           rounded_down_weight(block.down, weight))
    down = block.nodes["down"]
    for node in (down, *down.all_input_nodes):
        node.replace_input_with(block.down.node, rounded)
    return f", {plan.down_rows} down rows"


def _dtype_of(values, block: MLPBlock):
    weight = values.get(block.up.node)
    return weight.dtype if weight is not None else torch.float32


def simulate_attention(gm, graph, block: AttentionBlock, entry, ordered, values, report) -> None:
    """Masked simulation: the unselected heads' attention outputs are zeroed before the output
    projection (exact per token, any number of tokens; reads every weight)."""
    idx, _ = insert_selection(gm, graph, block, entry, ordered, values)
    core = block.nodes["core"]  # (B, H, T, D), or (B * H, T, D) with the heads folded into the batch axis
    folded = len(shape_of(core)) == 3
    users = list(core.users)
    with graph.inserting_before(core.next):
        scores = idx.args[0].args[0]  # idx = topk(scores, k)[1]
        mask = graph.call_function(torch.scatter, (graph.call_function(torch.zeros_like, (scores,)), -1, idx, 1.0))
        tokens = emit_size(graph, core, 1 if folded else 2)
        mask = graph.call_method("reshape", (mask, -1, tokens, block.num_heads))  # (B, T, H)
        mask = graph.call_method("unsqueeze", (graph.call_method("permute", (mask, 0, 2, 1)), -1))  # (B, H, T, 1)
        if folded:
            mask = graph.call_method("flatten", (mask, 0, 1))  # (B * H, T, 1), BLOOM's order
        masked = graph.call_function(operator.mul, (core, graph.call_method("type_as", (mask, core))))
    core.replace_all_uses_with(masked, delete_user_cb=lambda user: user in users)
    report.rewritten.append(f"layer {block.layer} attention: masked simulation, {entry.k}/{entry.total} heads")



class SimulationPass:
    """The plan as masks on dense blocks (option ``simulate``), in place of the sparse lowerings."""

    name = "simulate"

    def __call__(self, gm, ctx):
        before = len(ctx.report.rewritten)
        gm = simulate_plan(gm, ctx.match, ctx.plan, ctx.report, ctx.example_inputs, ctx.opts)
        ctx.count(self.name, len(ctx.report.rewritten) - before)
        return gm
