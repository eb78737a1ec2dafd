"""Head-sparse attention on decode-shaped graphs (the ``sparse_attention`` pass).

For each attention block with a sparse plan entry (k of H query heads):
1. the predictor (on the previous block's input, with lookahead) and top-k pick the query heads;
2. the query projection computes only the selected heads' rows (gather-GEMV, rows read in place)
   and scatters them into an otherwise zero query tensor, so the model's own head reshapes, rotary
   and per-head norm code run unchanged (the other heads' zeros are never read);
3. attention runs on the selected heads only: their queries and, for each, the keys/values of the
   KV head it reads (MHA, GQA, MQA), taken from the tensors the model attends over. The K and V
   projections and the cache update are the model's own and untouched, so the cache stays exact;
4. the output projection reads only the selected heads' rows of its transposed weight
   (embedding_bag).

Graph-level rather than one fused op (``dejavu::sparse_head_attention`` is the standalone op): the
model's rotary variant, q scaling and per-head norms are reused as traced, so no architecture needs
its own code. What a step cannot prove safe stays dense and is reported: the query projection when
it is fused with K/V or normalised across heads, the whole block when attention is not SDPA.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dejavu_compile.compiler.blocks import AttentionBlock
from dejavu_compile.compiler.passes.graph_build import (
    add_constant,
    bias_view,
    emit_gather_gemv,
    emit_size,
    emit_weighted_row_sum,
    erase_unused,
    rows_view,
    transposed_weight,
    value_device,
)
from dejavu_compile.compiler.passes.graph_utils import sdpa_arguments, shape_of
from dejavu_compile.compiler.passes.selection import insert_selection


def dense_reason(block: AttentionBlock) -> str | None:
    """Why the head-sparse lowering keeps this block dense, or None when it lowers it."""
    if block.attention != "sdpa":
        return (f"head-sparse attention needs scaled_dot_product_attention (this block runs {block.attention} "
                "attention): dense")
    args = sdpa_arguments(block.nodes.core)
    key_heads, H = shape_of(args["key"])[1], block.num_heads
    if key_heads not in (H, block.num_kv_heads) or H % key_heads:
        return f"attention reads {key_heads} key heads for {H} query heads: dense"
    mask = args.get("attn_mask")
    if isinstance(mask, fx.Node) and (shape_of(mask) is None or len(shape_of(mask)) != 4
                                      or shape_of(mask)[1] not in (1, H)):
        return f"attention mask of shape {shape_of(mask)}: dense"
    return None


def dense_query_reason(block: AttentionBlock) -> str | None:
    """None when the query projection's output feeds only the attention's query (so only the selected
    heads' rows need computing), else why the lowering keeps the query projection dense."""
    q = sdpa_arguments(block.nodes.core)["query"]
    if block.q.rows is not None:
        return "query projection fused with key/value"
    if block.qk_norm == "across_heads":
        return "query norm across heads"
    ancestors, stack = {q}, [q]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in ancestors:
                ancestors.add(a)
                stack.append(a)
    stack = [block.nodes.q_out]
    while stack:
        node = stack.pop()
        for user in node.users if node is not q else ():
            if user not in ancestors:
                return f"query projection output also feeds {user.name}"
            stack.append(user)
    return None


def _rewrite_query(gm, graph, block: AttentionBlock, idx, k, values) -> None:
    """q projection of the selected heads' rows, scattered into a zero tensor of the full width."""
    q_out, q_call, x = block.nodes.q_out, block.nodes.q, block.nodes.q_x
    weight = values.get(block.q.node)
    width = shape_of(q_out)[-1]
    table = block.nodes.head_rows["q"].to(device=value_device(values, block.q.node))
    rows_of_head = add_constant(gm, graph, f"dejavu_L{block.layer}_attention_q_rows", table)  # (H, D)
    with graph.inserting_before(q_call):
        x2d = graph.call_method("reshape", (x, -1, shape_of(x)[-1]))
        rows = graph.call_method("reshape", (graph.call_function(operator.getitem, (rows_of_head, idx)),
                                             -1, k * block.head_dim))  # (B, k*D)
        flat_rows = graph.call_method("reshape", (rows, -1))
        xb = graph.call_method("unsqueeze", (x2d, -1))
        w_q = rows_view(graph, block.q, weight)
        selected = emit_gather_gemv(graph, w_q, bias_view(graph, block.q), rows, flat_rows, xb)  # (B, k*D)
        full = graph.call_method("new_zeros", (x2d, (emit_size(graph, x2d, 0), width)))
        full = graph.call_function(torch.scatter, (full, 1, rows, selected))
        lead = graph.call_function(operator.getitem, (graph.call_method("size", (x,)), slice(None, -1)))
        shaped = graph.call_method("reshape", (full, graph.call_function(operator.add, (lead, (width,)))))
    q_out.replace_all_uses_with(shaped)
    erase_unused(graph, [q_out, q_call])


def rewrite_attention(gm, graph, block: AttentionBlock, entry, ordered, values, report, fallbacks) -> bool:
    """Lower one attention block to its k selected heads; False (reason on ``fallbacks``) when it stays dense."""
    reason = dense_reason(block)
    if reason is not None:
        fallbacks.append((block.module, reason))
        return False
    where = f"layer {block.layer} attention"
    idx, source = insert_selection(gm, graph, block, entry, ordered, values)
    query_reason = dense_query_reason(block)
    if query_reason is None:  # queries of the selected heads only
        _rewrite_query(gm, graph, block, idx, entry.k, values)
    else:
        report.rewritten.append(f"{where}: query projection kept dense ({query_reason})")
    heads, attn = _attend_selected_heads(graph, block, idx, entry.k)
    _project_selected_heads(gm, graph, block, heads, attn, entry.k, values, report)
    _erase_dense_attention(graph, block, where)
    report.rewritten.append(f"{where}: {entry.k}/{block.num_heads} heads"
                            f"{' (lookahead)' if source is not block.nodes.input else ''}")
    return True


def _attend_selected_heads(graph, block: AttentionBlock, idx, k) -> tuple[fx.Node, fx.Node]:
    """SDPA over the selected query heads and the KV heads they read (MHA, GQA, MQA).
    Returns (head ids (B, k, 1, 1), attention output (B, k, 1, D))."""
    core = block.nodes.core
    args = sdpa_arguments(core)
    H = block.num_heads
    key_heads = shape_of(args["key"])[1]
    mask = args.get("attn_mask")
    with graph.inserting_before(core):
        heads = graph.call_method("reshape", (idx, -1, k, 1, 1))  # (B, k, 1, 1)
        kv_heads = heads if key_heads == H else graph.call_function(
            torch.div, (heads, H // key_heads), {"rounding_mode": "floor"})
        new = dict(args)
        new["query"] = graph.call_function(torch.take_along_dim, (args["query"], heads, 1))
        new["key"] = graph.call_function(torch.take_along_dim, (args["key"], kv_heads, 1))
        new["value"] = graph.call_function(torch.take_along_dim, (args["value"], kv_heads, 1))
        if isinstance(mask, fx.Node) and shape_of(mask)[1] == H:
            new["attn_mask"] = graph.call_function(torch.take_along_dim, (mask, heads, 1))
        if "enable_gqa" in new:
            new["enable_gqa"] = False  # each selected query head now has its own key/value head
        positional = ("query", "key", "value")
        attn = graph.call_function(core.target, tuple(new.pop(name) for name in positional), new)
    return heads, attn


def _project_selected_heads(gm, graph, block: AttentionBlock, heads, attn, k, values, report) -> fx.Node:
    """The output projection over the selected heads' rows of its transposed weight, in place of the
    block's output (reshaped to the block input's leading dims)."""
    D = block.head_dim
    o_call, o_out = block.nodes.o, block.nodes.output
    with graph.inserting_before(o_call):
        w_o_t = transposed_weight(gm, graph, block.o, values.get(block.o.node),
                                   f"dejavu_L{block.layer}_attention_w_o_t", report,
                                   f"layer {block.layer} attention: output")
        offsets = graph.call_function(torch.arange, (D,), {"device": value_device(values, block.o.node)})
        rows = graph.call_function(operator.add, (graph.call_function(operator.mul, (heads, D)), offsets))
        rows = graph.call_method("reshape", (rows, -1, k * D))  # head h owns rows h*D:(h+1)*D (matcher-checked)
        weights = graph.call_method("reshape", (attn, -1, k * D))
        out = emit_weighted_row_sum(graph, rows, weights, k * D, w_o_t, block.o.bias_node)
        # Leading dims of the block's input (not of the old attention output, which must die with it).
        input_size = graph.call_method("size", (block.nodes.input,))
        lead = graph.call_function(operator.getitem, (input_size, slice(None, -1)))
        out_shape = graph.call_function(operator.add, (lead, (emit_size(graph, w_o_t, 1),)))
        shaped = graph.call_method("reshape", (out, out_shape))
    out.meta["dejavu"] = {"role": "sparse_attention", "layer": block.layer, "k": k}
    o_out.replace_all_uses_with(shaped)
    return out


def _erase_dense_attention(graph, block: AttentionBlock, where: str) -> None:
    """The dense SDPA, output projection and the reshapes between them go; the dense attention must
    not survive (it would run beside the sparse one)."""
    core, o_call, o_out = block.nodes.core, block.nodes.o, block.nodes.output
    region = [o_out, o_call] + [n for n in o_call.all_input_nodes if n.op != "placeholder"]  # addmm's flattening view
    node = block.nodes.o_input
    while node is not core:  # the reshapes between attention output and output projection
        region.append(node)
        node = node.args[0]
    erase_unused(graph, region + [core])
    if not getattr(core, "_erased", False):
        raise RuntimeError(f"{where}: the dense attention output has users outside its output projection")


def simulate_attention(gm, graph, block: AttentionBlock, entry, ordered, values, report) -> None:
    """Masked simulation: the unselected heads' attention outputs are zeroed before the output
    projection (exact per token, any number of tokens; reads every weight)."""
    idx, _ = insert_selection(gm, graph, block, entry, ordered, values)
    core = block.nodes.core  # (B, H, T, D), or (B * H, T, D) with the heads folded into the batch axis
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



class SparseAttentionPass:
    """Every matched attention block with a sparse plan entry attends over its selected heads only."""

    name = "sparse_attention"

    def __call__(self, gm, ctx):
        values, ordered = ctx.values(gm), ctx.ordered_blocks(gm)
        rewritten = 0
        for block in ctx.match.attention:
            entry = ctx.plan.entries.get((block.layer, "attention"))
            if entry is not None and not entry.dense:
                rewritten += rewrite_attention(gm, gm.graph, block, entry, ordered, values, ctx.report,
                                               ctx.match.fallbacks)
        ctx.count(self.name, rewritten)
        return gm
