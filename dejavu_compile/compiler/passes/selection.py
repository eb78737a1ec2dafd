"""Predictor plus top-k inserted as early as their inputs allow (lookahead: one block ahead)."""
from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from dejavu_compile.compiler.blocks import MLPBlock
from dejavu_compile.compiler.passes.graph_build import value_device
from dejavu_compile.compiler.passes.graph_utils import shape_of
from dejavu_compile.compiler.passes.lowering import choose_lowering
from dejavu_compile.compiler.passes.predictor_graph import emit_scores, predictor_input

log = logging.getLogger("dejavu_compile")


def takes_predictor_values(block: MLPBlock, entry, fallbacks) -> bool:
    """Whether the block takes its kept neurons' values from the int8 predictor (entry.values ==
    "predictor"). The int8 rows hold no biases: a block with gate or up biases keeps exact values,
    reported."""
    if entry.values != "predictor":
        return False
    if block.gate.bias_node is not None or block.up.bias_node is not None:
        fallbacks.append((block.module, "gate/up biases: the int8 predictor's values leave them out, so the "
                                        "kept neurons' values are computed exactly"))
        return False
    return True


def previous_input(block: MLPBlock, ordered_blocks) -> fx.Node:
    """The input of the block that runs before ``block`` (its lookahead source)."""
    position = ordered_blocks.index(block)
    own = block.nodes.input
    for earlier in reversed(ordered_blocks[:position]):
        if earlier.nodes.input is not own:
            return earlier.nodes.input
    return own


def insert_selection(gm, graph, block, entry, ordered, values, opts=None):
    """Predictor and top-k, right after the input they read (as early as their inputs allow).
    The int8 predictor is one op that scores and selects where the kernel lowering has one
    (``emit_int8_topk``: the C++ op ``cpu_glu_int8_topk`` on CPU, fp32 input: in a bf16 or fp16
    model the predictor's input is cast to fp32 first).

    Returns (flat (tokens, k) neuron or head ids, the node the predictor reads)."""
    x = block.nodes.input
    weight_node = block.up.node if isinstance(block, MLPBlock) else block.o.node
    weight_value = values.get(weight_node)
    dtype = weight_value.dtype if weight_value is not None else torch.float32
    device = value_device(values, weight_node)
    source = previous_input(block, ordered) if entry.lookahead else x
    prefix = f"dejavu_L{block.layer}_{block.kind}"
    kind = entry.predictor_kind
    # quantized predictors compute in fp32 in a model of any dtype, so their fused op applies to all
    lowering = (choose_lowering(opts, weight_value, dtype=torch.float32 if kind.quantized else None)
                if opts is not None else None)
    fused = kind.int8_rows and lowering is not None and lowering.fills("int8_topk")
    with graph.inserting_before(source.next):
        flat_source = graph.call_method("reshape", (source, -1, shape_of(source)[-1]))
        if fused:
            x_fp32, _ = predictor_input(graph, entry, flat_source, dtype)
            scores = idx = lowering.use(gm, "int8_topk")(gm, graph, entry, x_fp32, prefix, device)
        else:
            scores = emit_scores(gm, graph, entry, flat_source, prefix, dtype, device)
            top = graph.call_function(torch.topk, (scores, entry.k), {"dim": -1, "sorted": False})
            idx = graph.call_function(operator.getitem, (top, 1))
    for node in dict.fromkeys((scores, idx)):  # one node when the op fuses both: it is the predictor
        node.meta["dejavu"] = {"role": "predictor" if node is scores else "topk", "layer": block.layer,
                               "kind": block.kind, "reads": source.name, "lookahead": source is not x}
    return idx, source

