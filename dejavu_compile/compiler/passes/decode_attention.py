"""Pass ``decode_attention``: a CPU decode graph's attention through the backend's kernel.

At a decode step each sequence attends with one query row over its key/value cache.
``dejavu::cpu_decode_attention`` reads each key and value row of the cache once, as stored:
grouped-query heads share their key/value head in place (no repeated copy), slots the mask removes
are not read, sums are in fp32 and the result is rounded once. Exact up to summation order.

Grouped-query models repeat each key/value head for its query heads before SDPA (Hugging Face's
``repeat_kv``: ``x[:, :, None]`` expanded along the new dimension, then merged into the head
dimension), which copies the whole cache at every step. Where the key and value are that
expression of a cache tensor, the kernel takes the cache itself (query head h reads key/value head
h // n_rep, the head ``repeat_kv`` gives it) and the copies drop out of the graph.

It applies to SDPA calls on CPU tensors in fp32, bf16 or fp16 with at most ``MAX_QUERY_ROWS`` query
rows per head, no dropout, no causal flag (Hugging Face models pass the mask instead), one head
dimension for q, k and v, and a mask that is boolean or in fp32 or the model's dtype and broadcasts
to (batch, heads, rows, slots); others stay as traced. Training graphs and graphs that need
gradients are left alone. The pass runs with ``attention_lowering="auto"`` (the default; "aten"
leaves SDPA to the inner compiler, which copies the repeated cache at every step and visits every
slot: ``benchmarks/results/decode-attention.json``); ``dense_lowering="aten"`` turns it off with
``dense_linear``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dejavu_compile.compiler.passes.dense_linear import KERNEL_DTYPES, decode_lowering_off
from dejavu_compile.compiler.passes.graph_utils import example_value, sdpa_arguments
from dejavu_compile.compiler.passes.lowering import dense_kernel

# Query rows per (batch, head) up to which the kernel runs (kMaxAttentionRows in cpu_ops.cpp).
MAX_QUERY_ROWS = 16


def _static_shape(t, symbolic_dims=()) -> bool:
    """A tensor whose sizes are ints, except at ``symbolic_dims`` (counted from the end), where a size
    may be symbolic."""
    return isinstance(t, torch.Tensor) and all(
        isinstance(s, int) or (i - t.dim() in symbolic_dims and isinstance(s, torch.SymInt))
        for i, s in enumerate(t.shape))


def _same(a, b) -> bool:
    """Sizes known equal from the graph alone (an int, or the same symbolic size): no shape guard is added."""
    return statically_known_true(a == b)


def _may_match(a, b) -> bool:
    """Sizes equal, or one of them symbolic: the kernel compares the sizes it is given at run time and
    raises on a mismatch (where SDPA would raise too)."""
    return isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt) or a == b


def lowerable(args: dict) -> str | None:
    """Why this SDPA call keeps its traced op, or None when the decode kernel takes it. The number of
    cache slots may be symbolic: Dynamo makes it so once it has seen two cache lengths (a server whose
    requests allocate static caches of different sizes), and the kernel reads it from the tensors."""
    q, k, v = (example_value(args[n]) for n in ("query", "key", "value"))
    if not (_static_shape(q) and all(_static_shape(t, symbolic_dims=(-2,)) for t in (k, v))
            and all(t.dim() == 4 for t in (q, k, v))):
        return "not 4-D (batch, heads, rows, dim) tensors of static shape (but for the cache's slot count)"
    if any(t.device.type != "cpu" for t in (q, k, v)):
        return "not on the CPU"
    if q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"{q.dtype}, {k.dtype}, {v.dtype} (the kernel takes one of {', '.join(map(str, KERNEL_DTYPES))})"
    if q.shape[2] > MAX_QUERY_ROWS:
        return f"more than {MAX_QUERY_ROWS} query rows: prefill"
    if args["dropout_p"] != 0 or args["is_causal"] is not False:
        return "dropout or a causal flag"
    if not (isinstance(args["scale"], (int, float)) or args["scale"] is None):
        return "a scale that is not a constant"
    batch, heads, rows, dim = q.shape
    kv_heads = k.shape[1]
    if k.shape[0] != batch or (k.shape[1], v.shape[0], v.shape[1]) != (kv_heads, batch, kv_heads) \
            or not _may_match(v.shape[2], k.shape[2]) or k.shape[3] != dim or v.shape[3] != dim:
        return "keys and values whose shapes differ from the query's"
    if kv_heads != heads and not (args["enable_gqa"] is True and kv_heads > 0 and heads % kv_heads == 0):
        return "query heads that are not the key/value heads or a multiple of them under enable_gqa"
    mask = args["attn_mask"]
    if mask is not None:
        m = example_value(mask)
        if not _static_shape(m, symbolic_dims=(-1,)) or m.device.type != "cpu" \
                or m.dtype not in (torch.bool, torch.float32, q.dtype):
            return "a mask that is not boolean or of the model's dtype"
        full = (batch, heads, rows, k.shape[2])
        if m.dim() > 4 or not all(_same(s, 1) or _may_match(s, f) for s, f in zip(m.shape[::-1], full[::-1])):
            return f"a mask of shape {tuple(m.shape)} that does not broadcast to {tuple(full)}"
    return None


def _shape(node) -> tuple | None:
    """The node's shape; its length dimension (the second to last) may be symbolic."""
    value = example_value(node) if isinstance(node, fx.Node) else None
    return tuple(value.shape) if _static_shape(value, symbolic_dims=(-2,)) else None


def _inserts_unit_dims_only(node: fx.Node) -> bool:
    """``x[...]`` indexed with full slices, None and Ellipsis only, or ``x.unsqueeze(dim)``: a view that
    adds size-1 dimensions and keeps every element in place."""
    if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2:
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        return all(i is None or i is Ellipsis or i == slice(None) for i in index)
    return (node.op == "call_method" and node.target == "unsqueeze") or (
        node.op == "call_function" and node.target is torch.unsqueeze)


def repeated_kv_source(node) -> fx.Node | None:
    """x when ``node`` is ``repeat_kv(x, n_rep)`` as Hugging Face writes it (x (B, H, L, D) -> x[:, :, None]
    (B, H, 1, L, D) -> expand (B, H, n_rep, L, D) -> reshape (B, H * n_rep, L, D): head h of the
    result is head h // n_rep of x); None for anything else. Matched on the ops and their shapes:
    a reshape to that shape from that shape merges dimensions 1 and 2 whatever the sizes."""
    if not isinstance(node, fx.Node) or not (
            (node.op == "call_method" and node.target in ("reshape", "view"))
            or (node.op == "call_function" and node.target is torch.reshape)):
        return None
    expanded = node.args[0]
    if not (isinstance(expanded, fx.Node) and expanded.op == "call_method" and expanded.target == "expand"):
        return None
    unsqueezed = expanded.args[0]
    if not (isinstance(unsqueezed, fx.Node) and _inserts_unit_dims_only(unsqueezed)
            and isinstance(unsqueezed.args[0], fx.Node)):
        return None
    source = unsqueezed.args[0]
    shapes = [_shape(n) for n in (source, unsqueezed, expanded, node)]
    if any(s is None for s in shapes) or len(shapes[0]) != 4:
        return None
    (b, h, length, d), rep = shapes[0], shapes[2][2] if len(shapes[2]) == 5 else 0
    expected = [(b, h, 1, length, d), (b, h, rep, length, d), (b, h * rep, length, d)]
    if not isinstance(rep, int) or rep < 1 or not all(
            len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
            for got, want in zip(shapes[1:], expected)):
        return None
    return source


def _drop_if_unused(graph: fx.Graph, node) -> None:
    """Erase ``node`` and then its inputs, while each has no other user (the repeat_kv copies)."""
    while isinstance(node, fx.Node) and not node.users and node.op in ("call_method", "call_function"):
        inputs = node.all_input_nodes
        graph.erase_node(node)
        node = inputs[0] if len(inputs) == 1 else None


class DecodeAttentionPass:
    """Rewrites the graph's decode-shaped CPU SDPA calls into the kernel table's decode attention.
    Counts the calls rewritten."""

    name = "decode_attention"

    def __call__(self, gm: fx.GraphModule, ctx) -> fx.GraphModule:
        ctx.count(self.name, 0)
        if decode_lowering_off(gm, ctx) or ctx.opts.get("attention_lowering", "auto") == "aten":
            return gm
        graph, rewritten = gm.graph, 0
        for node in list(graph.nodes):
            args = sdpa_arguments(node)
            if args is None:
                continue
            traced = (args["key"], args["value"])
            sources = [repeated_kv_source(t) for t in traced]
            if all(s is not None for s in sources):
                # the cache itself, each key/value head shared in place by its n_rep query heads (lowerable
                # checks that key and value agree)
                grouped = {**args, "key": sources[0], "value": sources[1], "enable_gqa": True}
                if lowerable(grouped) is None:
                    args = grouped
            if lowerable(args) is not None:
                continue
            kernel = dense_kernel("decode_attention", ctx.opts, example_value(args["query"]))
            if kernel is None:
                continue
            with graph.inserting_after(node):
                out = kernel.use(gm, "decode_attention")(graph, args["query"], args["key"], args["value"],
                                                         args["attn_mask"], args["scale"])
            out.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "val", "stack_trace")})
            node.replace_all_uses_with(out)
            graph.erase_node(node)
            for t in traced:
                _drop_if_unused(graph, t)
            rewritten += 1
        ctx.count(self.name, rewritten)
        return gm
