"""Sparse lowering of matched MLP blocks on decode-shaped graphs (attention heads:
``sparsify_attention.py``, called from :func:`sparsify`).

For each MLP block with a sparse plan entry:
1. the predictor is inserted right after the input it reads, which is the previous block's input
   when the entry uses lookahead, so it can run beside that block ("as early as its inputs allow");
2. top-k turns its scores into the neuron ids to keep;
3. the block (gate/up projections, activation, down projection) is replaced by
   ``dejavu::sparse_gated_mlp`` / ``dejavu::sparse_mlp``, which read only the selected weight rows.

Only graphs with one token per sequence and at most ``max_batch`` sequences are rewritten; prefill
stays dense. Weights are used in place: gate/up rows straight from the parameters, the down
projection from its transpose, which is a free view when the parameter is stored transposed
(``prepare_model``) and otherwise a one-time copy held by the compiled graph."""
from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from dejavu_compile import activations
from dejavu_compile.compiler.blocks import MLPBlock
from dejavu_compile.compiler.passes.graph_build import (
    bias_view,
    emit_weighted_row_sum,
    erase_unused,
    rows_view,
    transposed_weight,
    value_device,
)
from dejavu_compile.compiler.passes.graph_utils import shape_of
from dejavu_compile.compiler.passes.lowering import cpu_lowering, emit_decomposed, unit_stride_rows
from dejavu_compile.compiler.passes.predictor_graph import emit_int8_selection, int8_constants
from dejavu_compile.compiler.passes.selection import insert_selection

log = logging.getLogger("dejavu_compile")


def _mlp_region_nodes(block: MLPBlock) -> list[fx.Node]:
    """Every node the dense block computed: projections, their views, the activation region."""
    out = [block.nodes["output"], block.nodes["down"], block.nodes["up"], block.nodes.get("gate")]
    stack = [block.nodes["hidden"]]
    seen = set()
    while stack:  # everything between the projections' outputs and the down projection's call
        node = stack.pop()
        if node in seen or node is block.nodes["input"]:
            continue
        seen.add(node)
        out.append(node)
        if node in (block.nodes["up"], block.nodes.get("gate")):
            continue
        stack.extend(node.all_input_nodes)
    down = block.nodes["down"]
    out.extend(n for n in down.all_input_nodes if n.op != "placeholder")
    return [n for n in out if n is not None and n.op != "placeholder"]


def rewrite_mlp(gm, graph, block: MLPBlock, entry, ordered, values, report, opts) -> None:
    x = block.nodes["input"]
    prefix = f"dejavu_L{block.layer}_mlp"
    idx, source = insert_selection(gm, graph, block, entry, ordered, values, opts)

    # 2. The sparse op in place of the block.
    down_value = values.get(block.down.node)
    with graph.inserting_before(block.nodes["down"]):
        x2d = graph.call_method("reshape", (x, -1, shape_of(x)[-1]))
        w_down_t = transposed_weight(gm, graph, block.down, down_value, f"{prefix}_w_down_t", report,
                                      f"layer {block.layer} mlp: down")
        b_down = block.down.bias_node
        w_up = rows_view(graph, block.up, values.get(block.up.node))
        b_up = bias_view(graph, block.up)
        w_gate = rows_view(graph, block.gate, values.get(block.gate.node)) if block.gated else None
        b_gate = bias_view(graph, block.gate) if block.gated else None
        refs = (block.gate, block.up) if block.gated else (block.up,)
        lowering = cpu_lowering(opts, values.get(block.up.node),
                                 all(unit_stride_rows(ref, values.get(ref.node)) for ref in refs))
        if lowering == "native":  # the C kernel's (w_a, w_b): (gate, up), or (up, None) for a plain MLP
            w_a, b_a, w_b, b_b = (w_gate, b_gate, w_up, b_up) if block.gated else (w_up, b_up, None, None)
            out = graph.call_function(torch.ops.dejavu.cpu_sparse_mlp.default,
                                      (x2d, w_a, w_b, w_down_t, idx, block.activation, b_a, b_b, b_down))
        elif lowering == "decomposed":
            out = emit_decomposed(graph, block, x2d, idx, entry.k, w_gate, b_gate, w_up, b_up, w_down_t, b_down)
        elif block.gated:
            out = graph.call_function(torch.ops.dejavu.sparse_gated_mlp.default,
                                      (x2d, w_gate, w_up, w_down_t, idx, block.activation, b_gate, b_up, b_down, False))
        else:
            out = graph.call_function(torch.ops.dejavu.sparse_mlp.default,
                                      (x2d, w_up, b_up, w_down_t, b_down, idx, block.activation, False))
        out.meta["dejavu"] = {"role": "sparse_mlp", "layer": block.layer, "k": entry.k}
    _replace_block(graph, block, out)
    report.rewritten.append(f"layer {block.layer} mlp: {entry.k}/{entry.total} neurons"
                            f"{' (lookahead)' if source is not x else ''}")


def _replace_block(graph, block: MLPBlock, out: fx.Node) -> None:
    """The block's output becomes `out` ((tokens, d), reshaped to the input's leading dims); the
    dense block's nodes go."""
    x = block.nodes["input"]
    with graph.inserting_before(out.next):
        size = graph.call_method("size", (x,))
        lead = graph.call_function(operator.getitem, (size, slice(None, -1)))
        shape = graph.call_function(operator.add, (lead, (block.hidden_size,)))
        shaped = graph.call_method("reshape", (out, shape))
    block.nodes["output"].replace_all_uses_with(shaped)
    erase_unused(graph, _mlp_region_nodes(block))


def rewrite_mlp_from_predictor(gm, graph, block: MLPBlock, entry, values, report, opts) -> None:
    """The block from its int8 predictor's values (entry.values == "predictor"): act(g~) * u~ for
    every neuron, the top k by magnitude, and those k values times their rows of the transposed
    down weight. The fp32 gate and up weights are not read. On CPU fp32 with the C++ ops all of it
    is one call (``dejavu::cpu_glu_int8_mlp``); elsewhere aten ops (int8_linear, topk, gather,
    embedding_bag)."""
    x = block.nodes["input"]
    prefix = f"dejavu_L{block.layer}_mlp"
    down_value = values.get(block.down.node)
    device = value_device(values, block.down.node)
    with graph.inserting_before(block.nodes["down"]):
        x2d = graph.call_method("reshape", (x, -1, shape_of(x)[-1]))
        w_down_t = transposed_weight(gm, graph, block.down, down_value, f"{prefix}_w_down_t", report,
                                      f"layer {block.layer} mlp: down")
        b_down = block.down.bias_node
        if cpu_lowering(opts, down_value) == "native":  # fp32 on CPU with the C++ ops
            q, scale = int8_constants(gm, graph, entry, prefix, device)
            both = graph.call_function(torch.ops.dejavu.cpu_glu_int8_mlp.default,
                                       (x2d, q, scale, w_down_t, entry.k, activations.canonical(entry.activation), b_down))
            both.meta["dejavu"] = {"role": "predictor", "layer": block.layer, "kind": "mlp", "reads": x.name,
                                   "lookahead": False}
            out = graph.call_function(operator.getitem, (both, 0))
        else:
            estimate, idx = emit_int8_selection(gm, graph, block, entry, x2d, prefix, device)
            kept = graph.call_function(torch.gather, (estimate, -1, idx))
            out = emit_weighted_row_sum(graph, idx, kept, entry.k, w_down_t, b_down)
        out.meta["dejavu"] = {"role": "sparse_mlp", "layer": block.layer, "k": entry.k}
    _replace_block(graph, block, out)
    report.rewritten.append(f"layer {block.layer} mlp: {entry.k}/{entry.total} neurons, values from the int8 "
                            "predictor (down rows only)")

