"""The dense projections of a CPU decode graph through the backend's GEMV kernel.

At decode shapes (a few rows of activations) a projection is a GEMV, and reading its weight is all
the work. Torch's GEMM path reads these small weights well below the memory bandwidth (measured in
``benchmarks/README.md``); ``dejavu::cpu_linear`` (kernels/cpu/cpu_ops.cpp) streams each weight
once. This pass rewrites every projection that is left in the graph after
the sparsity passes (attention projections, dense MLPs, the output head; with no plan, all of
them) into that op. Exact: every product is summed, only the summation order differs.

It applies to CPU projections in fp32, bf16 or fp16 (input, weight and bias in one dtype, as
``F.linear`` asks; the kernels read the weight as stored and sum in fp32) with at most ``MAX_ROWS``
rows of input and a weight with one unit stride (as stored, or transposed by ``prepare_model``);
others stay as traced. A decode graph that already calls ``dejavu::cpu_q8_linear`` (the projections
``quantize_weights(model, "int8")`` leaves) is noted as holding the native entry's ops, so it too is
compiled under Inductor's C++ wrapper (no Python call per projection). Training
graphs and graphs that need gradients are left alone (the op has no backward).

Sibling projections, those reading the same input (a layer's q, k and v; its gate and up when its
MLP stays dense), become one call whose outputs are concatenated (``cpu_linear_cat``, and
``cpu_q8_linear_cat`` for int8 projections), each projection's output a slice of it: one parallel
region over all their rows, and for int8 one quantization of x, where separate calls pay each once
per projection. The same products, summed in the same order. ``dense_lowering="unfused"`` keeps one
call per projection; ``dense_lowering="aten"`` turns the pass off.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.fx as fx

from dejavu_compile.compiler.passes.graph_utils import example_value, find_linears, int8_projection_ops
from dejavu_compile.compiler.passes.guards import needs_gradients, training_reason
from dejavu_compile.compiler.passes.lowering import dense_kernel

# What the C++ ops' kernels read (cpu_ops.cpp's kernel_dtype).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Rows of input up to which the op runs its GEMV kernels (kMaxGemvRows in cpu_ops.cpp); a prefill
# graph's projections keep Inductor's GEMM.
MAX_ROWS = 16


def _rows(x) -> int | None:
    """Rows of a (..., d) activation, when every size is a plain int."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        return None
    if not all(isinstance(s, int) for s in x.shape):
        return None
    return math.prod(x.shape[:-1])


def lowerable(x, weight, bias, layout: str) -> str | None:
    """Why this projection keeps its traced op, or None when cpu_linear takes it."""
    if not all(isinstance(t, torch.Tensor) for t in (x, weight)) or weight.dim() != 2:
        return "not a plain 2-D weight"
    if x.device.type != "cpu" or weight.device.type != "cpu":
        return "not on the CPU"
    if x.dtype not in KERNEL_DTYPES:
        return f"{x.dtype} (the kernels take {', '.join(str(t) for t in KERNEL_DTYPES)})"
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return "input, weight and bias in different dtypes"
    rows = _rows(x)
    if rows is None or not 1 <= rows <= MAX_ROWS:
        return f"more than {MAX_ROWS} rows (or a dynamic shape): a GEMM"
    w_stride = weight.stride() if layout == "out_in" else weight.stride()[::-1]  # strides of the (n, d) view
    if 1 not in w_stride:
        return "a weight without a unit stride"
    if bias is not None and (bias.dim() != 1 or bias.stride(0) != 1):
        return "a strided bias"
    return None


def decode_lowering_off(gm: fx.GraphModule, ctx) -> bool:
    """Whether the dense decode lowerings leave this graph alone: ``dense_lowering="aten"``,
    ``simulate``, or a graph for training or one that needs gradients (the ops have no backward)."""
    return (ctx.opts.get("dense_lowering", "auto") == "aten" or bool(ctx.opts.get("simulate"))
            or training_reason(gm, ctx.example_inputs) is not None or needs_gradients(ctx.example_inputs))


class DenseLinearPass:
    """Rewrites the graph's remaining decode-shaped CPU projections into ``dejavu::cpu_linear``.
    Counts the projections rewritten."""

    name = "dense_linear"

    def __call__(self, gm: fx.GraphModule, ctx) -> fx.GraphModule:
        ctx.count(self.name, 0)
        if decode_lowering_off(gm, ctx):
            return gm
        linears = find_linears(gm, int8=True).values()
        lowerings = []
        for lin in (lin for lin in linears if lin.scales is None):
            bias = example_value(lin.bias) if lin.bias is not None else None
            weight = example_value(lin.weight)
            if lowerable(example_value(lin.x), weight, bias, lin.layout) is None:
                kernel = dense_kernel("linear", ctx.opts, weight)
                if kernel is not None:
                    lowerings.append((lin, kernel))
        # quantize_weights' int8 projections are already the native entry's op: noted (the C++ wrapper),
        # and grouped with their siblings, but a lone one keeps the model's own call
        int8 = [lin for lin in linears if lin.scales is not None and _decode_int8_projection(lin.call)]
        owner = dense_kernel("linear", ctx.opts, None) if int8 else None
        if owner is not None:
            owner.note(gm)
        pairs = lowerings + ([(lin, owner) for lin in int8] if owner is not None else [])
        graph = gm.graph
        fuse = ctx.opts.get("dense_lowering", "auto") != "unfused"
        singles = []
        for group in _sibling_groups(graph, pairs) if fuse else [[pair] for pair in pairs]:
            kernel = group[0][1]
            if len(group) > 1 and kernel.fills("linear_cat"):
                _rewrite_siblings(gm, graph, kernel, [lin for lin, _ in group])
            else:
                singles.extend(pair for pair in group if pair[0].scales is None)
        for lin, kernel in singles:
            weight, last = lin.weight, lin.out
            if lin.layout == "in_out":  # (d, n) as stored: the op takes the (n, d) view
                with graph.inserting_after(last):
                    weight = last = graph.call_function(torch.t, (lin.weight,))
            with graph.inserting_after(last):
                out = kernel.use(gm, "linear")(graph, lin.x, weight, lin.bias)
            _replace_output(graph, lin, out)
        ctx.count(self.name, len(lowerings))
        return gm


def _sibling_groups(graph: fx.Graph, lowerings: list) -> list[list]:
    """The (projection, kernel) pairs grouped by what one concatenated call can take: the same input
    node, kernel and weight dtype, (out, in) weights with unit-stride rows, all with a bias or none,
    int8 weights of one group size, and every input defined before the group's first call (the call
    goes there). Groups keep graph order; a pair no other joins is a group of one."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    groups: dict = defaultdict(list)
    for lin, kernel in lowerings:
        weight = example_value(lin.weight)
        fusable = (lin.layout == "out_in" and isinstance(weight, torch.Tensor) and weight.dim() == 2
                   and weight.stride(-1) == 1)
        group_size = None
        if fusable and lin.scales is not None:
            scales = example_value(lin.scales)
            fusable = isinstance(scales, torch.Tensor) and scales.dim() == 2 and scales.shape[1] > 0
            group_size = weight.shape[1] // scales.shape[1] if fusable else None
        key = (lin.x, kernel.name, weight.dtype, lin.bias is None, group_size) if fusable else id(lin)
        groups[key].append((lin, kernel))
    result = []
    for members in groups.values():
        members.sort(key=lambda item: position[item[0].call])
        first = position[members[0][0].call]
        joined = [m for m in members if all(position[a] < first for a in _inputs(m[0]))]
        result.extend([joined] if len(joined) > 1 else [[m] for m in joined])
        result.extend([m] for m in members if m not in joined)
    return result


def _inputs(lin) -> list[fx.Node]:
    return [n for n in (lin.x, lin.weight, lin.bias, lin.scales) if n is not None]


def _rewrite_siblings(gm: fx.GraphModule, graph: fx.Graph, kernel, group: list) -> None:
    """One concatenated call before the group's first projection; each projection's output becomes
    its slice of the result."""
    with graph.inserting_before(group[0].call):
        bias = graph.call_function(torch.cat, ([lin.bias for lin in group],)) if group[0].bias is not None else None
        scales = [lin.scales for lin in group] if group[0].scales is not None else None
        out = kernel.use(gm, "linear_cat")(graph, group[0].x, [lin.weight for lin in group], scales, bias)
        starts = [sum(lin.out_features for lin in group[:i]) for i in range(len(group))]
        parts = [graph.call_function(torch.narrow, (out, -1, start, lin.out_features))
                 for lin, start in zip(group, starts)]
    for lin, part in zip(group, parts):  # after the inserts: erasing the first call moves the insertion point
        _replace_output(graph, lin, part)


def _replace_output(graph: fx.Graph, lin, out: fx.Node) -> None:
    """``out`` takes the place of the projection's output (with its example value and stack trace);
    the projection's own nodes go once nothing reads them."""
    out.meta.update({k: v for k, v in lin.out.meta.items() if k in ("example_value", "val", "stack_trace")})
    lin.out.replace_all_uses_with(out)
    _erase_unused(graph, [lin.out, lin.call, *lin.call.all_input_nodes])


def _decode_int8_projection(node: fx.Node) -> bool:
    """A ``dejavu::cpu_q8_linear`` call with at most ``MAX_ROWS`` rows of input."""
    if node.op != "call_function" or node.target not in int8_projection_ops():
        return False
    rows = _rows(example_value(node.args[0]))
    return rows is not None and 1 <= rows <= MAX_ROWS


def _erase_unused(graph: fx.Graph, nodes) -> None:
    """Erase the replaced projection's own nodes (its op, its bias add, addmm's flattening view)
    once nothing reads them; a graph-wide dead-code pass could drop in-place cache writes."""
    for node in nodes:
        if node.op == "call_function" and not node.users and not getattr(node, "_erased", False):
            graph.erase_node(node)
