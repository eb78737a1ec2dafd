"""Sparse lowering of matched MLP blocks on decode-shaped graphs (the ``sparse_mlp`` pass; attention
heads: ``sparse_attention.py``).

For each MLP block with a sparse plan entry:
1. the predictor is inserted right after the input it reads, which is the previous block's input
   when the entry uses lookahead, so it can run beside that block ("as early as its inputs allow");
2. top-k turns its scores into the neuron ids to keep;
3. the block (gate/up projections, activation, down projection) is replaced by the nodes of the
   kernel lowering ``lowering.choose_lowering`` picks, which read only the selected weight rows.

The ``decode_shape`` pass before it lets only graphs with one token per sequence and at most
``max_batch`` sequences through; prefill stays dense. Weights are used in place: gate/up rows
straight from the parameters, the down projection from its transpose, which is a free view when
the parameter is stored transposed (``prepare_model``) and otherwise a one-time copy held by the compiled graph."""
from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from dejavu_compile.compiler.blocks import MLPBlock
from dejavu_compile.compiler.passes.graph_build import (
    add_constant,
    bias_view,
    emit_weighted_row_sum,
    erase_unused,
    rows_view,
    transposed_weight,
    value_device,
    weight_copy,
)
from dejavu_compile.compiler.passes.graph_utils import shape_of
from dejavu_compile.compiler.passes.lowering import SparseMLPNodes, choose_lowering, unit_stride_rows
from dejavu_compile.compiler.passes.predictor_graph import emit_int8_selection
from dejavu_compile.compiler.passes.selection import insert_selection, takes_predictor_values
from dejavu_compile.kernels import ACTIVATIONS as KERNEL_ACTIVATIONS

log = logging.getLogger("dejavu_compile")


def _mlp_region_nodes(block: MLPBlock) -> list[fx.Node]:
    """Every node the dense block computed: projections, their views, the activation region."""
    out = [block.nodes.output, block.nodes.down, block.nodes.up, block.nodes.gate]
    stack = [block.nodes.hidden]
    seen = set()
    while stack:  # everything between the projections' outputs and the down projection's call
        node = stack.pop()
        if node in seen or node is block.nodes.input:
            continue
        seen.add(node)
        out.append(node)
        if node in (block.nodes.up, block.nodes.gate):
            continue
        stack.extend(node.all_input_nodes)
    down = block.nodes.down
    out.extend(n for n in down.all_input_nodes if n.op != "placeholder")
    return [n for n in out if n is not None and n.op != "placeholder"]


def rewrite_mlp(gm, graph, block: MLPBlock, entry, ordered, values, report, opts) -> None:
    x = block.nodes.input
    prefix = f"dejavu_L{block.layer}_mlp"
    idx, source = insert_selection(gm, graph, block, entry, ordered, values, opts)

    # 2. The sparse op in place of the block.
    down_value = values.get(block.down.node)
    with graph.inserting_before(block.nodes.down):
        x2d = graph.call_method("reshape", (x, -1, shape_of(x)[-1]))
        w_down_t = transposed_weight(gm, graph, block.down, down_value, f"{prefix}_w_down_t", report,
                                      f"layer {block.layer} mlp: down")
        b_down = block.down.bias_node
        w_up = rows_view(graph, block.up, values.get(block.up.node))
        b_up = bias_view(graph, block.up)
        w_gate = rows_view(graph, block.gate, values.get(block.gate.node)) if block.gated else None
        b_gate = bias_view(graph, block.gate) if block.gated else None
        refs = (block.gate, block.up) if block.gated else (block.up,)
        lowering = choose_lowering(opts, values.get(block.up.node),
                                   all(unit_stride_rows(ref, values.get(ref.node)) for ref in refs))
        nodes = SparseMLPNodes(block, x2d, idx, entry.k, w_gate, b_gate, w_up, b_up, w_down_t, b_down,
                               value_device(values, block.up.node))
        out = lowering.use(gm, "mlp")(graph, nodes)
        out.meta["dejavu"] = {"role": "sparse_mlp", "layer": block.layer, "k": entry.k}
    _replace_block(graph, block, out)
    report.rewritten.append(f"layer {block.layer} mlp: {entry.k}/{entry.total} neurons"
                            f"{' (lookahead)' if source is not x else ''}")


def int8_mlp_reason(block: MLPBlock) -> str | None:
    """Why a block of quantize_weights' int8 projections stays dense under a sparse entry, or None:
    the int8 path (``cpu_q8_glu_mlp``, and its masked simulation) takes gated blocks whose gate and
    up are whole projections without biases, with an activation of the kernels' table."""
    if not block.gated:
        return "a plain MLP of int8 projections: no sparse path for it, dense"
    if block.gate.rows is not None or block.up.rows is not None:
        return "gate and up fused in one int8 projection: no sparse path for it, dense"
    if block.gate.bias_node is not None or block.up.bias_node is not None:
        return "int8 gate/up projections with biases: no sparse path for them, dense"
    if block.activation not in KERNEL_ACTIVATIONS:
        return f"activation {block.activation!r} has no sparse kernel"
    return None


def int8_down_rows(gm, graph, block: MLPBlock, values, prefix: str) -> tuple[fx.Node, fx.Node]:
    """The down projection's own int8 values and scales, transposed ((F, d_out) and (F / group, d_out),
    contiguous): one row per neuron, as ``cpu_q8_glu_mlp`` reads them. Copies the compiled graph
    holds, built once per weight."""
    q, scales = values[block.down.node], values[block.down.scales_node]
    q_t = weight_copy(q, "int8 rows transposed", lambda w: w.t().contiguous())
    s_t = weight_copy(scales, "int8 scales transposed", lambda w: w.t().contiguous())
    return add_constant(gm, graph, f"{prefix}_q_down_t", q_t), add_constant(gm, graph, f"{prefix}_s_down_t", s_t)


def rewrite_int8_mlp(gm, graph, block: MLPBlock, entry, values, report) -> None:
    """A gated MLP of quantize_weights' int8 projections: one ``cpu_q8_glu_mlp`` call in place of the
    block. Its own int8 gate and up choose the kept neurons (the top k of |act(g) * u|, computed as the
    dense int8 projections compute them) and give their values; only those rows of the down weight
    are read. The entry's k is used; a predictor it carries is not: the block's own weights are the
    exact predictor for its format, and no second copy is read."""
    x = block.nodes.input
    prefix = f"dejavu_L{block.layer}_mlp"
    with graph.inserting_before(block.nodes.down):
        x2d = graph.call_method("reshape", (x, -1, shape_of(x)[-1]))
        q_down_t, s_down_t = int8_down_rows(gm, graph, block, values, prefix)
        both = graph.call_function(torch.ops.dejavu.cpu_q8_glu_mlp.default,
                                   (x2d, block.gate.node, block.gate.scales_node, block.up.node,
                                    block.up.scales_node, q_down_t, s_down_t, entry.k, block.activation,
                                    block.down.bias_node))
        out = graph.call_function(operator.getitem, (both, 0))
        both.meta["dejavu"] = {"role": "predictor", "layer": block.layer, "kind": "mlp", "reads": x.name,
                               "lookahead": False}
        out.meta["dejavu"] = {"role": "sparse_mlp", "layer": block.layer, "k": entry.k}
    _replace_block(graph, block, out)
    ignored = f", its own int8 gate/up in place of the plan's {entry.predictor} predictor" if entry.predictor else ""
    report.rewritten.append(f"layer {block.layer} mlp: {entry.k}/{entry.total} neurons, int8 weights "
                            f"(chosen and valued by its own gate/up{ignored})")


def _replace_block(graph, block: MLPBlock, out: fx.Node) -> None:
    """The block's output becomes `out` ((tokens, d), reshaped to the input's leading dims); the
    dense block's nodes go."""
    x = block.nodes.input
    with graph.inserting_before(out.next):
        size = graph.call_method("size", (x,))
        lead = graph.call_function(operator.getitem, (size, slice(None, -1)))
        shape = graph.call_function(operator.add, (lead, (block.hidden_size,)))
        shaped = graph.call_method("reshape", (out, shape))
    block.nodes.output.replace_all_uses_with(shaped)
    erase_unused(graph, _mlp_region_nodes(block))


def rewrite_mlp_from_predictor(gm, graph, block: MLPBlock, entry, values, report, opts) -> None:
    """The block from its int8 predictor's values (entry.values == "predictor"): act(g~) * u~ for
    every neuron, the top k by magnitude, and those k values times their rows of the transposed
    down weight. The gate and up weights are not read. Where the kernel lowering has one op for
    it (``dejavu::cpu_glu_int8_mlp`` on CPU) all of it is one call, reading the plan's bf16 copy
    of the down rows where ``plan.down_rows`` asks for one; elsewhere aten ops (int8_linear, topk,
    gather, embedding_bag over the model's down rows; the predictor in fp32, its kept values cast to
    the model's dtype)."""
    x = block.nodes.input
    prefix = f"dejavu_L{block.layer}_mlp"
    down_value = values.get(block.down.node)
    device = value_device(values, block.down.node)
    with graph.inserting_before(block.nodes.down):
        x2d = graph.call_method("reshape", (x, -1, shape_of(x)[-1]))
        b_down = block.down.bias_node
        lowering = choose_lowering(opts, down_value)
        fused = lowering.fills("int8_values_mlp")  # one op: the C++ op on CPU
        from_copy = fused and reads_down_copy(opts["plan"], down_value)
        if from_copy:  # the plan's bf16 copy of the down rows
            w_down_t = add_constant(gm, graph, f"{prefix}_down_{opts['plan'].down_rows}",
                                    down_rows_copy(down_rows(block.down, down_value)))
        else:
            w_down_t = transposed_weight(gm, graph, block.down, down_value, f"{prefix}_w_down_t", report,
                                         f"layer {block.layer} mlp: down")
        if fused:
            out, both = lowering.use(gm, "int8_values_mlp")(gm, graph, block, entry, x2d, w_down_t, b_down,
                                                              prefix, device)
            both.meta["dejavu"] = {"role": "predictor", "layer": block.layer, "kind": "mlp", "reads": x.name,
                                   "lookahead": False}
        else:
            dtype = down_value.dtype if down_value is not None else None
            estimate, idx = emit_int8_selection(gm, graph, block, entry, x2d, prefix, device, dtype)
            kept = graph.call_function(torch.gather, (estimate, -1, idx))
            kept = graph.call_method("type_as", (kept, w_down_t))  # fp32 values onto the model's down rows
            out = emit_weighted_row_sum(graph, idx, kept, entry.k, w_down_t, b_down)
        out.meta["dejavu"] = {"role": "sparse_mlp", "layer": block.layer, "k": entry.k}
    _replace_block(graph, block, out)
    rows = f"{opts['plan'].down_rows} copy of the down rows" if from_copy else "down rows only"
    report.rewritten.append(f"layer {block.layer} mlp: {entry.k}/{entry.total} neurons, values from the int8 "
                            f"predictor ({rows})")


def reads_down_copy(plan, down_weight: torch.Tensor | None) -> bool:
    """Whether an int8-valued MLP with this down weight reads the plan's bf16 copy of its kept rows:
    the plan asks for one and the weight is fp32 on the CPU (where the C++ op reads the copy; the
    masked simulation rounds the same blocks)."""
    return (plan.down_rows != "model" and down_weight is not None and down_weight.dtype == torch.float32
            and down_weight.device.type == "cpu")


def down_rows(ref, value: torch.Tensor) -> torch.Tensor:
    """A down projection's weight as (F, d_out) rows, one per neuron (a view)."""
    return value.t() if ref.layout == "out_in" else value


def down_rows_copy(rows: torch.Tensor) -> torch.Tensor:
    """The plan's bf16 copy of (F, d_out) down rows (contiguous), built once per weight."""
    return weight_copy(rows, "bf16 rows", lambda w: w.to(torch.bfloat16).contiguous())


def rounded_down_weight(ref, value: torch.Tensor) -> torch.Tensor:
    """The down weight, in its own layout and dtype, rounded as the plan's bf16 copy rounds it (the
    masked simulation's weight for entries that read the copy)."""
    rows = down_rows_copy(down_rows(ref, value)).to(value.dtype)
    return rows.t() if ref.layout == "out_in" else rows


def simulate_mlp(gm, graph, block: MLPBlock, entry, plan, ordered, values, report, fallbacks, opts) -> None:
    """The masked simulation of ``rewrite_mlp`` / ``rewrite_mlp_from_predictor``: the same predictor
    and top-k, the kept neurons as a 0/1 mask on the dense hidden activations (or on the int8
    predictor's values, with the plan's rounded down rows where the op reads that copy). Exact per
    token, any number of tokens; reads every weight."""
    hidden = block.nodes.hidden
    if block.up.int8:
        _simulate_int8_mlp(graph, block, entry, report, fallbacks)
        return
    from_predictor = takes_predictor_values(block, entry, fallbacks)
    if from_predictor:  # the predictor's own values, masked: what cpu_glu_int8_mlp sums
        x = block.nodes.input
        with graph.inserting_before(hidden.next):
            x2d = graph.call_method("reshape", (x, -1, shape_of(x)[-1]))
            estimate, idx = emit_int8_selection(gm, graph, block, entry, x2d, f"dejavu_L{block.layer}_mlp",
                                                 value_device(values, block.up.node))
    else:
        idx, _ = insert_selection(gm, graph, block, entry, ordered, values, opts)
    with graph.inserting_before(idx.next if from_predictor else hidden.next):  # after idx and hidden
        flat = graph.call_method("reshape", (hidden, -1, block.intermediate_size))
        kept = graph.call_method("type_as", (estimate, flat)) if from_predictor else flat
        zeros = graph.call_function(torch.zeros_like, (flat,))
        ones = graph.call_function(torch.ones_like, (idx,), {"dtype": _dtype_of(values, block)})
        mask = graph.call_function(torch.scatter, (zeros, -1, idx, ones))
        masked_flat = graph.call_function(operator.mul, (kept, mask))
        masked = graph.call_method("view_as", (masked_flat, hidden))
    hidden.replace_all_uses_with(masked, delete_user_cb=lambda user, ours=(flat, masked): user not in ours)
    copy_note = _round_down_rows(gm, graph, block, plan, values) if from_predictor else ""
    report.rewritten.append(f"layer {block.layer} mlp: masked simulation, {entry.k}/{entry.total} neurons"
                            f"{', values from the int8 predictor' if from_predictor else ''}{copy_note}")


def _simulate_int8_mlp(graph, block: MLPBlock, entry, report, fallbacks) -> None:
    """``rewrite_int8_mlp`` as a mask: the dense int8 block's hidden values, all but the k largest
    |act(g) * u| of each token zeroed, into its dense int8 down projection."""
    reason = int8_mlp_reason(block)
    if reason is not None:
        fallbacks.append((block.module, reason))
        return
    hidden = block.nodes.hidden
    with graph.inserting_before(hidden.next):
        flat = graph.call_method("reshape", (hidden, -1, block.intermediate_size))
        magnitude = graph.call_method("abs", (flat,))
        top = graph.call_function(torch.topk, (magnitude, entry.k), {"dim": -1, "sorted": False})
        idx = graph.call_function(operator.getitem, (top, 1))
        zeros = graph.call_function(torch.zeros_like, (flat,))
        ones = graph.call_function(torch.ones_like, (idx,), {"dtype": torch.float32})
        mask = graph.call_function(torch.scatter, (zeros, -1, idx, graph.call_method("type_as", (ones, flat))))
        masked = graph.call_method("view_as", (graph.call_function(operator.mul, (flat, mask)), hidden))
    hidden.replace_all_uses_with(masked, delete_user_cb=lambda user: user not in (flat, masked))
    report.rewritten.append(f"layer {block.layer} mlp: masked simulation, {entry.k}/{entry.total} neurons, int8 "
                            "weights (chosen by its own gate/up)")


def _round_down_rows(gm, graph, block: MLPBlock, plan, values) -> str:
    """The plan's bf16 copy of the down rows, as the dense down projection's weight: what the decode
    op reads (CPU fp32 models, where the C++ op runs)."""
    weight = values.get(block.down.node)
    if not reads_down_copy(plan, weight):
        return ""
    rounded = add_constant(gm, graph, f"dejavu_L{block.layer}_down_{plan.down_rows}",
                           rounded_down_weight(block.down, weight))
    down = block.nodes.down
    for node in (down, *down.all_input_nodes):
        node.replace_input_with(block.down.node, rounded)
    return f", {plan.down_rows} down rows"


def _dtype_of(values, block: MLPBlock):
    weight = values.get(block.up.node)
    return weight.dtype if weight is not None else torch.float32


class SparseMLPPass:
    """Every matched MLP with a sparse plan entry and a kernel for its activation becomes a
    predictor, top-k and a sparse MLP kernel (see :mod:`.lowering` for which)."""

    name = "sparse_mlp"

    def __call__(self, gm, ctx):
        plan, match, graph = ctx.plan, ctx.match, gm.graph
        values, ordered = ctx.values(gm), ctx.ordered_blocks(gm)
        rewritten = 0
        for block in match.mlp:
            entry = plan.entries.get((block.layer, "mlp"))
            if entry is None or entry.dense:
                continue
            if block.up.int8:
                reason = int8_mlp_reason(block)
                if reason is not None:
                    match.fallbacks.append((block.module, reason))
                    continue
                rewrite_int8_mlp(gm, graph, block, entry, values, ctx.report)
            elif block.activation not in KERNEL_ACTIVATIONS:
                match.fallbacks.append((block.module, f"activation {block.activation!r} has no sparse kernel"))
                continue
            elif takes_predictor_values(block, entry, match.fallbacks):
                rewrite_mlp_from_predictor(gm, graph, block, entry, values, ctx.report, ctx.opts)
            else:
                rewrite_mlp(gm, graph, block, entry, ordered, values, ctx.report, ctx.opts)
            rewritten += 1
        ctx.count(self.name, rewritten)
        return gm
