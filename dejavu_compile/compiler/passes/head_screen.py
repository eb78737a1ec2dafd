"""Pass ``head_screen``: a decode graph's output head reads an int8 copy of its weight, and only the
rows of the tokens that copy ranks highest in fp32.

The output head is one GEMV over the whole vocabulary, on a small model the largest weight a decode
step reads (SmolLM2-135M: 113 MB of the 537 MB a dense step reads). Which tokens matter is input
dependent and easy to predict: the head's own rows at 8 bits (one scale per row) estimate every
logit, and the ``plan.head_candidates`` highest of each row are recomputed from the fp32 weight.
Those candidates' logits are exactly the dense GEMV's (greedy decoding reads only the highest;
sampling draws mostly from them); the others keep the int8 estimate. The masked simulation applies the same screen
(``simulate_head``), so the plan's held-out perplexity includes it.

The head is the one projection with as many outputs as the token embedding has rows whose result
reaches the graph's output through elementwise and shape ops only. On CPU fp32 it becomes
``dejavu::cpu_screened_linear``; elsewhere (other dtypes or devices, no C++ ops) it stays dense
and the report says why. The int8 copy is built from the weight at compile time (no data needed)
and cached per weight, so recompiled graphs share it.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from dejavu_compile.compiler.passes.dense_linear import lowerable
from dejavu_compile.compiler.passes.graph_build import add_constant, erase_unused, weight_copy
from dejavu_compile.compiler.passes.graph_utils import (
    LinearCall,
    example_value,
    find_linears,
    is_elementwise,
    is_shape_op,
    module_of,
    shape_of,
)
from dejavu_compile.compiler.passes.lowering import dense_kernel
from dejavu_compile.kernels.int8 import quantize_rows_int8

EMBEDDING_FUNCTIONS = {F.embedding, torch.embedding}


def output_head(gm: fx.GraphModule) -> LinearCall | None:
    """The graph's output head: the single projection with as many outputs as the token embedding
    has rows whose result reaches the output through elementwise and shape ops only."""
    vocab = {shape_of(n.args[1])[0] for n in gm.graph.nodes
             if n.op == "call_function" and n.target in EMBEDDING_FUNCTIONS and len(shape_of(n.args[1]) or ()) == 2}
    heads = [lin for lin in find_linears(gm).values() if lin.out_features in vocab and _only_feeds_output(lin.out)]
    return heads[0] if len(heads) == 1 else None


def _only_feeds_output(node: fx.Node) -> bool:
    """Every use of `node` leads to the graph's output through elementwise and shape ops (so the
    logits feed no loss or other computation inside the graph)."""
    stack, seen, reached = [node], set(), False
    while stack:
        current = stack.pop()
        for user in current.users:
            if user.op == "output":
                reached = True
            elif user in seen:
                continue
            elif is_elementwise(user) or is_shape_op(user):
                seen.add(user)
                stack.append(user)
            else:
                return False
    return reached


def _screen_constants(gm: fx.GraphModule, lin: LinearCall, weight: torch.Tensor) -> tuple[fx.Node, fx.Node]:
    """Graph inputs holding the int8 copy of the head's (vocab, d) rows and their fp32 scales, built
    once per weight."""
    rows = weight if lin.layout == "out_in" else weight.t()
    q, scale = weight_copy(rows, "int8 rows", quantize_rows_int8)
    return add_constant(gm, gm.graph, "dejavu_head_int8", q), add_constant(gm, gm.graph, "dejavu_head_scale", scale)


def screen_reason(lin: LinearCall, k: int, opts: dict) -> str | None:
    """Why this head keeps its dense projection, or None when the screen lowers it."""
    x, weight = example_value(lin.x), example_value(lin.weight)
    bias = example_value(lin.bias) if lin.bias is not None else None
    if k >= lin.out_features:
        return f"head_candidates={k} covers all {lin.out_features} outputs"
    reason = lowerable(x, weight, bias, lin.layout)
    if reason is not None:
        return reason
    if dense_kernel("screened_head", opts, weight) is None:
        return "no kernel for the screened head here (the C++ CPU ops are unavailable)"
    return None


class HeadScreenPass:
    """The output head of a decode graph through ``dejavu::cpu_screened_linear`` when the plan
    screens it (``plan.head_candidates`` > 0). Counts the heads rewritten (0 or 1)."""

    name = "head_screen"

    def __call__(self, gm, ctx):
        ctx.count(self.name, 0)
        k = ctx.plan.head_candidates
        if k <= 0:
            return gm
        lin = output_head(gm)
        if lin is None:
            ctx.match.fallbacks.append(("output head", "no single projection onto the vocabulary feeds the "
                                                       "graph's output: the head stays dense"))
            return gm
        where = f"output head ({module_of(lin.weight_name)})"
        reason = screen_reason(lin, k, ctx.opts) if lin.weight in ctx.values(gm) else "its weight is not a graph input"
        if reason is not None:
            ctx.match.fallbacks.append((where, f"{reason}: the head stays dense"))
            return gm
        graph = gm.graph
        q_node, scale_node = _screen_constants(gm, lin, ctx.values(gm)[lin.weight])
        with graph.inserting_before(lin.out.next):
            weight = lin.weight if lin.layout == "out_in" else graph.call_function(torch.t, (lin.weight,))
            kernel = dense_kernel("screened_head", ctx.opts, ctx.values(gm)[lin.weight])
            out = kernel.use(gm, "screened_head")(graph, lin.x, weight, q_node, scale_node, k, lin.bias)
        out.meta.update({key: v for key, v in lin.out.meta.items() if key in ("example_value", "val", "stack_trace")})
        out.meta["dejavu"] = {"role": "head_screen", "k": k}
        lin.out.replace_all_uses_with(out)
        erase_unused(graph, [lin.out, lin.call, *lin.call.all_input_nodes])
        ctx.report.rewritten.append(f"{where}: int8 screen of {lin.out_features} rows, the top {k} exact")
        ctx.count(self.name, 1)
        return gm


def simulate_head(gm: fx.GraphModule, k: int, values: dict, report) -> None:
    """The screen on any number of tokens (the masked simulation): int8 estimates of every logit
    through ``dejavu::int8_linear`` (the kernel ``cpu_screened_linear`` runs first), the top k of each
    token replaced by the dense logits."""
    lin = output_head(gm)
    if k <= 0 or lin is None or k >= lin.out_features or lin.weight not in values:
        return
    graph = gm.graph
    q_node, scale_node = _screen_constants(gm, lin, values[lin.weight])
    users = list(lin.out.users)
    with graph.inserting_before(lin.out.next):
        x2d = graph.call_method("reshape", (lin.x, -1, lin.in_features))
        estimate = graph.call_function(torch.ops.dejavu.int8_linear.default,
                                       (graph.call_method("float", (x2d,)), q_node, scale_node))
        if lin.bias is not None:
            estimate = graph.call_function(torch.add, (estimate, graph.call_method("float", (lin.bias,))))
        idx = graph.call_function(operator.getitem, (graph.call_function(torch.topk, (estimate, k, -1)), 1))
        dense = graph.call_method("reshape", (lin.out, -1, lin.out_features))
        exact = graph.call_function(torch.gather, (dense, -1, idx))
        screened = graph.call_function(torch.scatter, (graph.call_method("type_as", (estimate, dense)), -1, idx, exact))
        screened = graph.call_method("view_as", (screened, lin.out))
    for user in users:
        user.replace_input_with(lin.out, screened)
    report.rewritten.append(f"output head: masked simulation of the int8 screen, the top {k} of "
                            f"{lin.out_features} exact")
