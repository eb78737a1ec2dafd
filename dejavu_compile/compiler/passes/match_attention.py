"""Attention rule: from the attention core back to its q/k/v projections, forward to its output one.

The core is ``scaled_dot_product_attention(q, k, v)`` or eager ``matmul(softmax(q @ k^T ...), v)``.
Each of q, k, v is traced back to the nearest projection (through rotary, cache writes and head
reshapes); the rows of that projection each head reads are found by running the reshape chain on
row ids, which covers separate, sliced (``qkv_proj``), split (``c_attn``) and per-head interleaved
(``query_key_value``) layouts alike. The output projection is reached through reshapes only.
"""
from __future__ import annotations

import operator

import networkx as nx
import torch
import torch.fx as fx
import torch.nn.functional as F

from dejavu_compile.compiler.blocks import AttentionBlock, AttentionNodes
from dejavu_compile.compiler.passes.graph_utils import (
    SDPA,
    LinearCall,
    common_module,
    evaluate,
    example_value,
    is_op,
    is_shape_op,
    layer_index,
    location,
    shape_of,
)

MATMUL = {torch.matmul, operator.matmul, torch.bmm}
SOFTMAX_F = {F.softmax, torch.softmax}
_PASS_THROUGH = {F.dropout, torch.nn.functional.dropout}


def _arg(node: fx.Node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def attention_core(node: fx.Node):
    """(q, k, v, kind, position bias or None) when ``node`` computes attention, else None.

    q, k and v are (batch, heads, tokens, head_dim) tensors. Eager attention may fold the heads into
    the batch axis (BLOOM: ``bmm`` over (batch * heads, tokens, head_dim)); the folding reshapes are
    looked through, and the core's output keeps its folded shape.
    """
    if node.op == "call_function" and node.target in SDPA:
        q, k, v = _arg(node, 0, "query"), _arg(node, 1, "key"), _arg(node, 2, "value")
        return q, k, v, "sdpa", _per_head_bias(_arg(node, 3, "attn_mask"), shape_of(q))
    if not (node.op == "call_function" and node.target in MATMUL) or len(node.args) != 2:
        return None
    probs, value = node.args
    cur = probs
    while isinstance(cur, fx.Node) and (cur.target in _PASS_THROUGH or is_op(
            cur, methods={"to", "float", "type", "type_as", "contiguous", "view", "reshape"})):
        cur = cur.args[0]
    if not (isinstance(cur, fx.Node) and (cur.target in SOFTMAX_F or is_op(cur, methods={"softmax"}))):
        return None
    # Scores: walk back from the softmax input through scale, mask, bias and casts to q @ k^T
    # (or baddbmm(bias, q, k^T): BLOOM's ALiBi folded into the product).
    stack, seen, scores, addends = [cur.args[0]], set(), [], []
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target in MATMUL:
            scores.append((n, n.args[0], n.args[1]))
        elif is_op(n, {torch.baddbmm}, {"baddbmm"}):
            batch1 = n.kwargs.get("batch1", n.args[1] if len(n.args) > 1 else None)
            batch2 = n.kwargs.get("batch2", n.args[2] if len(n.args) > 2 else None)
            scores.append((n, batch1, batch2))
            addends.append(n.kwargs.get("input", n.args[0]))
        elif n.op in ("call_function", "call_method") and (
                is_op(n, {operator.mul, operator.truediv, operator.add, operator.imul, operator.itruediv,
                          operator.iadd, torch.mul, torch.add, torch.div, torch.tanh, torch.where, torch.clamp},
                      {"to", "float", "masked_fill", "mul", "div", "add", "tanh", "type_as", "view", "reshape"})):
            stack.extend(n.all_input_nodes)
            if is_op(n, {operator.add, operator.iadd, torch.add}, {"add"}):
                addends.extend(n.all_input_nodes)
    if len(scores) != 1:
        return None
    product, query, key_t = scores[0]
    downstream, stack = set(), [product]  # the scores themselves, on their way to the softmax
    while stack:
        n = stack.pop()
        if n not in downstream:
            downstream.add(n)
            stack.extend(u for u in n.users if u in seen)
    addends = [a for a in addends if a not in downstream]
    if not isinstance(key_t, fx.Node) or not is_op(key_t, {torch.transpose}, {"transpose"}):
        return None
    rank = len(shape_of(key_t) or ())
    if rank not in (3, 4) or {d % rank for d in key_t.args[1:3]} != {rank - 2, rank - 1}:
        return None
    query, key, value = (_unfold_heads(t) for t in (query, key_t.args[0], value))
    if any(t is None for t in (query, key, value)):
        return None
    q_shape = shape_of(query)
    bias = next((b for b in (_per_head_bias(a, q_shape) for a in addends) if b is not None), None)
    return query, key, value, "eager", bias


def _unfold_heads(node):
    """The (batch, heads, tokens, head_dim) tensor behind ``node``: itself when 4-D, the input of the
    reshape that folded its heads into the batch axis when 3-D, else None."""
    shape = shape_of(node)
    if shape is not None and len(shape) == 4:
        return node
    if shape is None or len(shape) != 3 or not is_op(node, {torch.reshape}, {"reshape", "view"}):
        return None
    source = node.args[0]
    inner = shape_of(source)
    if inner is None or len(inner) != 4 or inner[0] * inner[1] != shape[0] or tuple(inner[2:]) != tuple(shape[1:]):
        return None
    return source


def _per_head_bias(node, q_shape):
    """``node`` when it is an additive score term with one slice per query head (ALiBi's slopes):
    (batch * heads, ...) or (..., heads, tokens, keys), as opposed to a mask shared by the heads."""
    shape = shape_of(node) if isinstance(node, fx.Node) else None
    if not shape or q_shape is None or len(q_shape) != 4 or q_shape[1] == 1:
        return None
    batch, heads = q_shape[:2]
    if len(shape) == 3 and shape[0] in (batch * heads, heads):
        return node
    if len(shape) == 4 and shape[1] == heads:
        return node
    return None


def frontier_linears(graph: nx.DiGraph, node: fx.Node, linears: dict[fx.Node, LinearCall]):
    """Projections reached walking back from ``node`` without passing another projection."""
    found, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in linears:
            found.append(linears[n])
            continue
        stack.extend(graph.predecessors(n))
    return found


def _propagate_ids(region: list[fx.Node], lin: LinearCall, ids: torch.Tensor) -> dict:
    """Carry row ids from the projection output through the region.

    Reshapes, slices and concatenations run on the ids; any other op (scaling, rotary arithmetic,
    per-head norms) passes on the ids of its first operand of the same shape, since it does not move
    values between positions.
    """
    env: dict = {lin.out: ids}
    for node in region:
        if node is lin.out:
            continue
        chain = [a for a in node.all_input_nodes if a in env and env[a] is not None]
        if not chain:
            continue
        foreign = [a for a in node.all_input_nodes
                   if a not in env and isinstance(example_value(a), torch.Tensor)]
        if (is_shape_op(node) or node.target in (torch.cat, torch.stack)) and not foreign:
            try:
                evaluate([node], env)
                continue
            except Exception:
                env[node] = None
                continue
        shape = shape_of(node)
        same = [a for a in chain if isinstance(env[a], torch.Tensor) and tuple(env[a].shape) == shape]
        env[node] = env[same[0]] if same else None
    return env


def _head_rows(graph: nx.DiGraph, lin: LinearCall, target: fx.Node, head_dim: int):
    """Rows of ``lin``'s weight each head reads, as an (heads, head_dim) tensor, and the head tensor.

    The head tensor is the first (B, heads, T, head_dim) node after the projection. Ids
    ``row + out * token`` carried to it tell which row lands where and prove that its third axis is
    the token axis.
    """
    order = {n: i for i, n in enumerate(lin.out.graph.nodes)}
    region = (nx.descendants(graph, lin.out) & (nx.ancestors(graph, target) | {target})) | {lin.out}
    region = sorted(region, key=order.__getitem__)
    out_shape = shape_of(lin.out)
    if out_shape is None or len(out_shape) != 3:
        return None
    batch, tokens, width = out_shape
    ids = (torch.arange(width, dtype=torch.float64) +
           width * torch.arange(tokens, dtype=torch.float64)[:, None]).expand(batch, tokens, width)
    env = _propagate_ids(region, lin, ids)
    for cand in region:
        shape = shape_of(cand)
        value = env.get(cand)
        if shape is None or len(shape) != 4 or shape[3] != head_dim or shape[2] != tokens or \
                not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            continue
        token_of = torch.div(value, width, rounding_mode="floor")
        if not torch.equal(token_of, torch.arange(tokens, dtype=torch.float64)[None, None, :, None]
                           .expand_as(token_of)):
            continue
        rows = (value[0, :, 0, :] % width).long()
        if rows.unique().numel() != rows.numel():
            continue
        return rows, cand
    return None


def _qk_norm(graph: nx.DiGraph, lin: LinearCall, head: fx.Node, head_dim: int) -> str:
    """"none", "per_head" (Qwen3, Gemma3) or "across_heads" (OLMo-2): a norm between projection and heads."""
    path = nx.descendants(graph, lin.out) & nx.ancestors(graph, head)
    for node in path:
        if is_op(node, {torch.mean, torch.sum, torch.var, torch.norm}, {"mean", "sum", "var", "norm"}):
            source = shape_of(node.args[0])
            return "per_head" if source and source[-1] == head_dim else "across_heads"
        if node.op == "call_function" and "norm" in getattr(node.target, "__name__", ""):
            source = shape_of(node.args[0])
            return "per_head" if source and source[-1] == head_dim else "across_heads"
    return "none"


def _is_rotary_factor(graph: nx.DiGraph, node) -> bool:
    """A position-dependent tensor (RoPE's cos/sin tables), as opposed to a norm's weights.

    It is computed with cos/sin, or read from a buffer or an input (GPT-J's precomputed table),
    where a norm weight derives from parameters alone.
    """
    if not isinstance(node, fx.Node):
        return False
    for a in nx.ancestors(graph, node) | {node}:
        if is_op(a, {torch.cos, torch.sin}, {"cos", "sin"}):
            return True
        if a.op == "placeholder" and not _is_parameter(a):
            return True
    return False


def _is_parameter(node: fx.Node) -> bool:
    source = getattr(node, "_dynamo_source", None)
    while source is not None:
        if getattr(source, "member", None) == "_parameters":
            return True
        source = getattr(source, "base", None)
    return isinstance(example_value(node), torch.nn.Parameter)


def _passes_unrotated(graph: nx.DiGraph, start: fx.Node, end: fx.Node, region: set) -> bool:
    """True when ``start`` reaches ``end`` without a multiplication (the pass-through part of RoPE)."""
    stack, seen = [start], set()
    while stack:
        n = stack.pop()
        if n is end:
            return True
        if n in seen or (n is not start and is_op(n, {operator.mul, torch.mul}, {"mul"})):
            continue
        if shape_of(n) is not None and 0 in shape_of(n):  # an empty pass-through slice passes nothing
            continue
        seen.add(n)
        stack.extend(s for s in graph.successors(n) if s in region or s is end)
    return False


def _rows_span(rows: torch.Tensor):
    flat = rows.flatten()
    if torch.equal(flat, torch.arange(int(flat[0]), int(flat[0]) + flat.numel())):
        return int(flat[0]), int(flat[0]) + flat.numel()
    return None


class AttentionRule:
    """Self-attention with any projection layout, rotary variant, KV cache and head sharing."""

    name = "attention"
    kind = "attention"

    def match(self, ctx):
        graph = ctx.graph
        linears_by_input: dict[fx.Node, list[LinearCall]] = {}
        for lin in ctx.linears.values():
            linears_by_input.setdefault(lin.x, []).append(lin)
        for node in list(ctx.gm.graph.nodes):
            core = attention_core(node)
            if core is None:
                continue
            block = self._match_core(ctx, graph, node, core, linears_by_input)
            if block is not None:
                yield block

    def _match_core(self, ctx, graph, node, core, linears_by_input):
        """The attention block around the SDPA call ``node``, or None (reason recorded as a fallback)."""
        q, k, v, kind, position_bias = core
        where = location(node)
        q_shape = shape_of(q)
        if q_shape is None or len(q_shape) != 4:
            return ctx.fallback(node, where, "attention query is not (batch, heads, tokens, head_dim)")
        _, num_heads, tokens, head_dim = q_shape
        found = _output_projection(node, linears_by_input)
        if isinstance(found, str):
            return ctx.fallback(node, where, found)
        o_lin, chain, o_input = found
        if ctx.is_claimed(o_lin.call):
            return None
        reason = _heads_in_order_reason(node, chain, o_input, num_heads, tokens, head_dim)
        if reason is None:
            roles = _qkv_projections(ctx, graph, {"q": q, "k": k, "v": v}, head_dim)
            reason = roles if isinstance(roles, str) else None
        if reason is None:
            inputs = {ctx.see_through(lin.x) for lin, _, _ in roles.values()}
            num_kv = roles["k"][1].shape[0]
            if len(inputs) != 1:
                reason = "q, k and v read different inputs (cross-attention?)"
            elif roles["v"][1].shape[0] != num_kv or num_heads % num_kv:
                reason = "key and value head counts do not fit the query heads"
        if reason is not None:
            return ctx.fallback(o_lin.call, where, reason)

        q_lin, _, q_heads = roles["q"]
        weights = {role: ctx.weight_ref(lin, _weight_rows(lin, rows)) for role, (lin, rows, _) in roles.items()}
        weights["o"] = ctx.weight_ref(o_lin, None)
        layer = layer_index(o_lin.weight_name)
        block = AttentionBlock(
            layer=-1 if layer is None else layer,
            rule=self.name,
            **weights,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rotary=_rotary_kind(graph, q_lin, q, head_dim),
            qk_norm=_qk_norm(graph, q_lin, q_heads, head_dim),
            cache=_cache_kind(graph, roles["k"][2], k),
            attention=kind,
            position_bias="none" if position_bias is None else "alibi",
            kv_sharing="mha" if num_kv == num_heads else ("mqa" if num_kv == 1 else "gqa"),
            decode=tokens == 1,
            tokens=tokens,
            batch=q_shape[0],
            module=common_module([w.name for w in weights.values()]),
            nodes=AttentionNodes(input=next(iter(inputs)), core=node, o_input=o_input, o=o_lin.call,
                                 output=o_lin.out, q=roles["q"][0].call, k=roles["k"][0].call,
                                 v=roles["v"][0].call, q_x=q_lin.x, q_out=q_lin.out,
                                 head_rows={r: rows for r, (_, rows, _) in roles.items()},
                                 position_bias=position_bias),
        )
        ctx.claim(o_lin.call, block, [node])
        return block


def _weight_rows(lin: LinearCall, rows: torch.Tensor):
    """The (start, stop) rows of the weight a role's heads span; None when that is all of it."""
    span = _rows_span(rows)
    return None if span == (0, lin.out_features) else span


def _output_projection(node: fx.Node, linears_by_input):
    """The projection reading the attention output through reshapes only: (its LinearCall, the
    reshape chain, the node it reads), or why there is none."""
    cur, chain = node, []
    while cur not in linears_by_input:
        users = list(cur.users)
        if len(users) != 1 or not is_shape_op(users[0]):
            return "no output projection after the attention output"
        cur = users[0]
        chain.append(cur)
    return linears_by_input[cur][0], chain, cur


def _heads_in_order_reason(node, chain, o_input, num_heads, tokens, head_dim) -> str | None:
    """Why the output projection does not read the heads as (tokens, heads * head_dim) in order
    (the reshape chain is run on position ids), or None."""
    ids = torch.arange(num_heads * tokens * head_dim, dtype=torch.float64)
    core_shape = shape_of(node)
    batch = core_shape[0] // num_heads if len(core_shape) == 3 else core_shape[0]  # heads folded into batch
    ids = ids.view(tokens, num_heads, head_dim).transpose(0, 1)[None].expand(batch, -1, -1, -1)
    if len(core_shape) == 3:
        ids = ids.reshape(core_shape)
    try:
        o_in = evaluate(chain, {node: ids})[o_input] if chain else ids
    except Exception as exc:
        return f"cannot follow the heads into the output projection ({exc})"
    expected = torch.arange(tokens * num_heads * head_dim, dtype=torch.float64)
    if tuple(o_in.shape[-1:]) != (num_heads * head_dim,) or not torch.equal(o_in[0].reshape(-1), expected):
        return "output projection does not read heads in order"
    return None


def _qkv_projections(ctx, graph, tensors: dict, head_dim: int):
    """role -> (projection, (heads, head_dim) row table, the node where its heads are split off) for
    q, k and v, or why one of them does not come from one projection's rows."""
    roles = {}
    for role, tensor in tensors.items():
        projections = frontier_linears(graph, tensor, ctx.linears)
        if len(projections) != 1:
            return f"{role} comes from {len(projections)} projections"
        lin = projections[0]
        found = _head_rows(graph, lin, tensor, head_dim)
        if found is None:
            return f"cannot map the heads of {role} to rows of {lin.weight_name}"
        roles[role] = (lin, *found)
    return roles


def _cache_kind(graph: nx.DiGraph, k_heads: fx.Node, k: fx.Node) -> str:
    """How keys reach attention: "index_copy" (a static cache written in place), "cat" (a
    dynamic cache grown along the tokens dim) or "none"."""
    cache = "none"
    for n in (nx.descendants(graph, k_heads) & nx.ancestors(graph, k)) | {k}:
        if is_op(n, methods={"index_copy_", "copy_", "index_put_"}):
            cache = "index_copy"
        elif n.op == "call_function" and n.target is torch.cat and cache == "none":
            dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0)
            if dim % 4 == 2:
                cache = "cat"
    return cache


def _rotary_kind(graph: nx.DiGraph, q_lin: LinearCall, q: fx.Node, head_dim: int) -> str:
    """"full", "partial" (part of each head passes unrotated) or "none": whether the query path
    multiplies by rotary factors, and whether a slice of the head skips them."""
    q_path = (nx.descendants(graph, q_lin.out) & (nx.ancestors(graph, q) | {q})) | {q_lin.out}
    if not any(is_op(n, {operator.mul, torch.mul}, {"mul"}) and
               any(a not in q_path and _is_rotary_factor(graph, a) for a in n.all_input_nodes) for n in q_path):
        return "none"
    sliced = [n for n in q_path if n.op == "call_function" and n.target is operator.getitem
              and n.args[0] in q_path and isinstance(n.args[1], tuple) and shape_of(n)
              and shape_of(n)[-1] > 0 and shape_of(n)[-1] < head_dim]
    return "partial" if any(_passes_unrotated(graph, n, q, q_path) for n in sliced) else "full"
