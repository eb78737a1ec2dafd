"""Predictor scores as graph nodes: what each plan entry's predictor computes from its block input."""
from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from dejavu_compile import activations
from dejavu_compile.compiler.blocks import MLPBlock
from dejavu_compile.compiler.passes.graph_build import add_constant

log = logging.getLogger("dejavu_compile")


def emit_scores(gm, graph, entry, x2d: fx.Node, prefix: str, dtype, device) -> fx.Node:
    """Nodes computing the entry's scores from a (B, d) input; weights become graph constants."""
    def const(suffix, t):
        return add_constant(gm, graph, f"{prefix}_{suffix}", t.detach().to(device=device, dtype=dtype).contiguous())

    if entry.nonlinearity == "glu_int8":
        return graph.call_function(torch.abs, (emit_int8_values(gm, graph, entry, x2d, prefix, device),))
    if entry.nonlinearity == "glu_int4":
        return graph.call_function(torch.abs, (_emit_int4_values(gm, graph, entry, x2d, prefix, dtype, device),))

    h = graph.call_function(torch.matmul, (x2d, const("A", entry.A)))
    if entry.a is not None:
        h = graph.call_function(operator.add, (h, const("a", entry.a)))
    B = entry.B
    if entry.nonlinearity == "glu":
        r = B.shape[0] // 2
        h_gate = graph.call_function(operator.getitem, (h, (Ellipsis, slice(0, r))))
        h_up = graph.call_function(operator.getitem, (h, (Ellipsis, slice(r, None))))
        fn = activations.torch_fn(entry.activation)
        g = graph.call_function(fn, (graph.call_function(torch.matmul, (h_gate, const("B_gate", B[:r]))),))
        u = graph.call_function(torch.matmul, (h_up, const("B_up", B[r:])))
        return graph.call_function(torch.abs, (graph.call_function(operator.mul, (g, u)),))
    if entry.nonlinearity == "relu":
        h = graph.call_function(torch.relu, (h,))
    scores = graph.call_function(torch.matmul, (h, const("B", B)))
    if entry.b is not None:
        scores = graph.call_function(operator.add, (scores, const("b", entry.b)))
    return scores


def int8_constants(gm, graph, entry, prefix: str, device) -> tuple[fx.Node, fx.Node]:
    """The int8 predictor's (2F, d) int8 rows and their (2F,) fp32 scales, as graph constants."""
    q = add_constant(gm, graph, f"{prefix}_A_int8", entry.A.detach().to(device=device).contiguous())
    scale = add_constant(gm, graph, f"{prefix}_a", entry.a.detach().to(device=device, dtype=torch.float32).contiguous())
    return q, scale


def emit_int8_values(gm, graph, entry, x2d: fx.Node, prefix: str, device) -> fx.Node:
    """(B, F) act(g~) * u~ of a "glu_int8" entry, signed: its scores' magnitude, and the kept
    neurons' values when the entry's values are "predictor"."""
    q, scale = int8_constants(gm, graph, entry, prefix, device)
    return _emit_gated(graph, entry, graph.call_function(torch.ops.dejavu.int8_linear.default, (x2d, q, scale)))


def _emit_gated(graph, entry, h: fx.Node) -> fx.Node:
    """act(g~) * u~ from a quantized predictor's (B, 2F) pre-activations [g~, u~]."""
    g = graph.call_function(operator.getitem, (h, (Ellipsis, slice(0, entry.total))))
    u = graph.call_function(operator.getitem, (h, (Ellipsis, slice(entry.total, None))))
    fn = activations.torch_fn(entry.activation)
    return graph.call_function(operator.mul, (graph.call_function(fn, (g,)), u))


def _emit_int4_values(gm, graph, entry, x2d: fx.Node, prefix: str, dtype, device) -> fx.Node:
    """(B, F) act(g~) * u~ of a "glu_int4" entry: its 4-bit codes unpacked and scaled to (2F, d) rows
    in the model's dtype, then one matmul. The constants are the packed codes and fp16 scales; the
    rows are dequantized on every call (no int4 GEMV kernel yet). Spelled out rather than calling
    ``predictors.dequantize_int4`` (same arithmetic, via int8 codes): in SmolLM2 decode steps that
    form ran at 0.32x Inductor dense against this one's 0.51x (`benchmarks/decode.py --skip-synthetic
    --predictors int4 --densities 0.5 --new-tokens 8 --repeats 1`)."""
    packed = add_constant(gm, graph, f"{prefix}_A_int4", entry.A.detach().to(device=device).contiguous())
    scales = add_constant(gm, graph, f"{prefix}_a", entry.a.detach().to(device=device).contiguous())
    rows, groups = entry.a.shape
    low = graph.call_function(torch.bitwise_and, (packed, 15))
    high = graph.call_function(torch.bitwise_right_shift, (packed, 4))
    codes = graph.call_function(torch.stack, ([low, high], -1))  # (2F, d/2, 2): column 2j, then 2j + 1
    codes = graph.call_method("reshape", (codes, rows, groups, -1))
    centred = graph.call_function(operator.sub, (graph.call_method("to", (codes, dtype)), 8))
    scale = graph.call_method("unsqueeze", (graph.call_method("to", (scales, dtype)), -1))
    weight = graph.call_method("reshape", (graph.call_function(operator.mul, (centred, scale)), rows, -1))
    h = graph.call_function(torch.matmul, (x2d, graph.call_method("t", (weight,))))
    if entry.b is not None:
        h = graph.call_function(operator.add, (h, add_constant(gm, graph, f"{prefix}_b",
                                                         entry.b.detach().to(device=device, dtype=dtype).contiguous())))
    return _emit_gated(graph, entry, h)


def emit_int8_selection(gm, graph, block: MLPBlock, entry, x2d: fx.Node, prefix: str, device):
    """For values "predictor" entries off the fused op: the int8 predictor's signed values (B, F)
    and the ids of the k largest in magnitude (B, k), the values node tagged as the predictor."""
    estimate = emit_int8_values(gm, graph, entry, x2d, prefix, device)
    estimate.meta["dejavu"] = {"role": "predictor", "layer": block.layer, "kind": "mlp",
                               "reads": block.nodes["input"].name, "lookahead": False}
    top = graph.call_function(torch.topk, (graph.call_function(torch.abs, (estimate,)), entry.k),
                              {"dim": -1, "sorted": False})
    return estimate, graph.call_function(operator.getitem, (top, 1))

