"""The sparsity pass's driver: plan check, then each matched block with a sparse plan entry is
rewritten (``sparse_mlp.py``, ``sparse_attention.py``) or simulated (``simulate.py``)."""
from __future__ import annotations

import logging

import torch.fx as fx

from dejavu_compile.compiler.passes.graph_build import placeholder_values
from dejavu_compile.compiler.passes.plan_check import check_plan_against_blocks
from dejavu_compile.compiler.passes.selection import takes_predictor_values
from dejavu_compile.compiler.passes.simulate import simulate_plan
from dejavu_compile.compiler.passes.sparse_attention import rewrite_attention
from dejavu_compile.compiler.passes.sparse_mlp import rewrite_mlp, rewrite_mlp_from_predictor
from dejavu_compile.kernels import ACTIVATIONS as KERNEL_ACTIVATIONS  # also registers the dejavu:: ops

log = logging.getLogger("dejavu_compile")


def sparsify(gm: fx.GraphModule, example_inputs, report, opts) -> fx.GraphModule:
    plan = opts["plan"]
    match = report.match
    check_plan_against_blocks(plan, match.blocks)
    if not match.blocks:
        report.dense_reason = "no MLP or attention block matched"
        return gm
    for block in match.blocks:
        if block.layer < 0:
            match.fallbacks.append((block.module, "the graph holds this block without its layer's path (a graph "
                                                  "break inside the model), so no plan entry applies: dense"))
    tokens = {b.tokens for b in match.blocks}
    batch = max(b.batch for b in match.blocks)
    if opts.get("simulate"):
        return simulate_plan(gm, match, plan, report, example_inputs, opts)
    if tokens != {1}:
        report.dense_reason = f"prefill-shaped graph ({max(tokens)} tokens per sequence): dense"
        return gm
    if batch > opts["max_batch"]:
        report.dense_reason = f"batch {batch} > max_batch {opts['max_batch']}: dense"
        return gm

    values = placeholder_values(gm, example_inputs)
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    ordered = sorted(match.blocks, key=lambda b: order[b.nodes["input"]] if b.nodes["input"] in order else -1)
    for block in match.mlp:
        entry = plan.entries.get((block.layer, "mlp"))
        if entry is None or entry.dense:
            continue
        if block.activation not in KERNEL_ACTIVATIONS:
            match.fallbacks.append((block.module, f"activation {block.activation!r} has no sparse kernel"))
            continue
        if takes_predictor_values(block, entry, match.fallbacks):
            rewrite_mlp_from_predictor(gm, graph, block, entry, values, report, opts)
        else:
            rewrite_mlp(gm, graph, block, entry, ordered, values, report, opts)
    for block in match.attention:
        entry = plan.entries.get((block.layer, "attention"))
        if entry is not None and not entry.dense:
            rewrite_attention(gm, graph, block, entry, ordered, values, report, match.fallbacks)
    graph.lint()
    gm.recompile()
    return gm

