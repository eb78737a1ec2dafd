"""Graph-building helpers shared by the sparse lowerings and the simulation: constants the
rewritten graph carries, weight views, and the gather/row-sum forms Inductor fuses."""
from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx
from torch.utils.weak import WeakIdKeyDictionary

from dejavu_compile.compiler.blocks import WeightRef

log = logging.getLogger("dejavu_compile")

# weight tensor -> {tag: (the weight's state, its copy)}; weak, so a freed model frees its copies
_weight_copies: WeakIdKeyDictionary = WeakIdKeyDictionary()


def placeholder_values(gm: fx.GraphModule, example_inputs) -> dict[fx.Node, torch.Tensor]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return dict(zip(placeholders, example_inputs))


def add_constant(gm: fx.GraphModule, graph: fx.Graph, name: str, tensor: torch.Tensor) -> fx.Node:
    """A tensor the rewritten graph needs (predictor weights): an extra trailing graph input.

    Inductor only accepts the parameters Dynamo lifted as get_attr, so new tensors travel as inputs;
    the backend appends their values (``gm.meta["dejavu_extra_inputs"]``) on every call.
    """
    extra = gm.meta.setdefault("dejavu_extra_inputs", [])
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        node = graph.placeholder(name.replace(".", "_"))
    node.meta["example_value"] = tensor  # as on Dynamo's placeholders; no "val": with one placeholder
    # carrying "val", Inductor's cpp_wrapper takes every example input from that key (None for Dynamo's)
    node._dynamo_source = None  # not from user code (AOTAutograd accepts a None source)
    node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}  # static for CUDA graphs
    extra.append(tensor)
    return node


def weight_copy(weight: torch.Tensor, tag: str, make):
    """``make(weight)`` (a compact copy the compiled graph holds: int8 rows, bf16 rows), computed once
    per weight, layout, version and ``tag``, so the graphs of one model (prefill, decode, recompiles)
    share it. ``weight`` may be a view (a transpose): the copy is keyed by the tensor it views."""
    base = weight._base if weight._base is not None else weight
    state = (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, weight._version)
    copies = _weight_copies.setdefault(base, {})
    hit = copies.get(tag)
    if hit is not None and hit[0] == state:
        return hit[1]
    with torch.no_grad():
        copy = make(weight)
    copies[tag] = (state, copy)
    return copy


def rows_view(graph, ref: WeightRef, tensor: torch.Tensor | None) -> fx.Node:
    """The (F, d) rows of a gate/up weight, as a view of the parameter placeholder."""
    node = ref.node
    if ref.layout == "in_out":
        node = graph.call_method("t", (node,))
    if ref.rows is not None:
        node = graph.call_function(operator.getitem, (node, slice(*ref.rows)))
    return node


def bias_view(graph, ref: WeightRef) -> fx.Node | None:
    if ref.bias_node is None:
        return None
    node = ref.bias_node
    if ref.rows is not None:
        node = graph.call_function(operator.getitem, (node, slice(*ref.rows)))
    return node


def erase_unused(graph: fx.Graph, nodes) -> None:
    nodes = [n for n in dict.fromkeys(nodes) if n is not None and n.graph is graph]
    changed = True
    while changed:
        changed = False
        for node in list(nodes):
            if not node.users and node.op in ("call_function", "call_method"):
                graph.erase_node(node)
                nodes.remove(node)
                changed = True


def emit_size(graph, node, dim) -> fx.Node:
    return graph.call_method("size", (node, dim))


def value_device(values, node) -> torch.device:
    """The device of a weight placeholder's example value (CPU when it has none)."""
    value = values.get(node)
    return value.device if value is not None else torch.device("cpu")


def emit_gather_gemv(graph, weight, bias, idx, flat_idx, xb) -> fx.Node:
    """(B, n) = weight[idx[b]] . x_b (+ bias[idx]): index_select + one-column bmm, which Inductor on
    CPU fuses into one loop reading the selected rows in place."""
    rows = graph.call_function(torch.index_select, (weight, 0, flat_idx))  # (B*n, d)
    rows = graph.call_method("view", (rows, -1, emit_size(graph, idx, -1), emit_size(graph, weight, 1)))  # (B, n, d)
    value = graph.call_method("squeeze", (graph.call_function(torch.bmm, (rows, xb)), -1))  # (B, n)
    if bias is not None:
        value = graph.call_function(operator.add, (value, graph.call_function(operator.getitem, (bias, idx))))
    return value


def emit_weighted_row_sum(graph, idx, weights, n, table, bias) -> fx.Node:
    """(B, out) = sum_j weights[b, j] * table[idx[b, j]] (+ bias): embedding_bag, rows read in place.

    One bag per row runs on one thread: each row's n ids are cut into `bags` bags (summed after), so
    the row sums run on all cores (benchmarks/README.md, "Splitting the row sums into bags").
    When no bag count divides n, each row is padded with up to 3 ids of row 0 at weight 0 (calibrated
    plans keep k on multiples of 32; a hand-made plan need not: 70% of SmolLM2's 1536 is 1075)."""
    bags = next((s for s in (4, 3, 2) if n % s == 0 and n // s >= 32), min(4, n // 32))
    if bags > 1:
        width = -(-n // bags)
        if width * bags != n:
            pad = (0, width * bags - n)
            idx = graph.call_function(torch.nn.functional.pad, (idx, pad))
            weights = graph.call_function(torch.nn.functional.pad, (weights, pad))
        idx = graph.call_method("reshape", (idx, -1, width))
        weights = graph.call_method("reshape", (weights, -1, width))
    out = graph.call_function(torch.nn.functional.embedding_bag, (idx, table),
                              {"mode": "sum", "per_sample_weights": weights})
    if bags > 1:
        out = graph.call_method("sum", (graph.call_method("view", (out, -1, bags, emit_size(graph, table, 1))), 1))
    if bias is not None:
        out = graph.call_function(operator.add, (out, bias))
    return out


def transposed_weight(gm, graph, ref: WeightRef, value, name: str, report, what: str) -> fx.Node:
    """A projection's weight as (in, out) rows, one contiguous row per input feature."""
    if ref.layout == "in_out":  # Conv1D is (in, out): already the transposed layout
        return ref.node
    if value is not None and value.t().is_contiguous():
        return graph.call_method("t", (ref.node,))  # stored transposed: a free view
    report.rewritten.append(f"{what} weight copied transposed "
                            "(call dejavu_compile.prepare_model(model) to avoid the copy)")
    return add_constant(gm, graph, name, value.detach().t().contiguous())

