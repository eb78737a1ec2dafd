"""Predictor scores as graph nodes: each plan entry's predictor kind supplies a plain torch function,
inserted as one node whose tensors are graph constants (AOTAutograd traces through it for Inductor)."""
from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from dejavu_compile.compiler.blocks import MLPBlock
from dejavu_compile.compiler.passes.graph_build import add_constant

log = logging.getLogger("dejavu_compile")


def predictor_constants(gm, graph, entry, prefix: str, dtype, device) -> tuple[dict[str, fx.Node], dict]:
    """The entry's predictor tensors as graph constants (named as its kind names them), and the other
    keyword arguments of its graph functions."""
    tensors, options = entry.predictor_kind.graph_inputs(entry.tensors, entry.activation, dtype)
    nodes = {name: add_constant(gm, graph, f"{prefix}_{name}", t.detach().to(device=device).contiguous())
             for name, t in tensors.items()}
    return nodes, options


def predictor_input(graph, entry, x2d: fx.Node, dtype) -> tuple[fx.Node, torch.dtype]:
    """The (B, d) input the entry's predictor reads and the dtype it computes in: quantized kinds
    score in fp32 whatever the model's dtype (as calibration and ``PredictorKind.scores`` do, so
    the compiled graph selects the neurons the plan was measured with); others in the model's."""
    if entry.predictor_kind.quantized and dtype != torch.float32:  # None (unknown): cast, free when fp32
        return graph.call_method("to", (x2d, torch.float32)), torch.float32
    return x2d, dtype


def emit_scores(gm, graph, entry, x2d: fx.Node, prefix: str, dtype, device) -> fx.Node:
    """(B, total) scores of the entry's predictor from a (B, d) input of a model in `dtype`."""
    x2d, dtype = predictor_input(graph, entry, x2d, dtype)
    nodes, options = predictor_constants(gm, graph, entry, prefix, dtype, device)
    return graph.call_function(entry.predictor_kind.graph_scores, (x2d,), {**nodes, **options})


def int8_constants(gm, graph, entry, prefix: str, device) -> tuple[fx.Node, fx.Node]:
    """The (2F, d) int8 rows and (2F,) fp32 scales of an entry whose kind has ``int8_rows``: the
    operands of the fused C++ int8 ops."""
    assert entry.predictor_kind.int8_rows, entry.predictor
    nodes, _ = predictor_constants(gm, graph, entry, prefix, torch.float32, device)
    return entry.predictor_kind.int8_operands(nodes)


def emit_values(gm, graph, entry, x2d: fx.Node, prefix: str, dtype, device) -> fx.Node:
    """(B, F) signed act(g~) * u~ of an entry whose kind ``gives_values``: its scores' magnitude, and
    the kept neurons' values when the entry's values are "predictor" (fp32 for the quantized
    kinds, see ``predictor_input``: the caller casts the kept values to the model's dtype)."""
    kind = entry.predictor_kind
    x2d, dtype = predictor_input(graph, entry, x2d, dtype)
    nodes, options = predictor_constants(gm, graph, entry, prefix, dtype, device)
    return graph.call_function(kind.graph_values, (x2d,), {**nodes, **options})


def emit_int8_selection(gm, graph, block: MLPBlock, entry, x2d: fx.Node, prefix: str, device, dtype=None):
    """For values "predictor" entries off the fused op: the predictor's signed fp32 values (B, F) and
    the ids of the k largest in magnitude (B, k), the values node tagged as the predictor. `dtype`:
    the model's (None: unknown)."""
    estimate = emit_values(gm, graph, entry, x2d, prefix, dtype, device)
    estimate.meta["dejavu"] = {"role": "predictor", "layer": block.layer, "kind": "mlp",
                               "reads": block.nodes.input.name, "lookahead": False}
    top = graph.call_function(torch.topk, (graph.call_function(torch.abs, (estimate,)), entry.k),
                              {"dim": -1, "sorted": False})
    return estimate, graph.call_function(operator.getitem, (top, 1))
