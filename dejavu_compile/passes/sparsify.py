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
(``prepare_model``) and otherwise a one-time copy held by the compiled graph.
"""
from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from dejavu_compile.kernels import ACTIVATIONS as KERNEL_ACTIVATIONS  # also registers the dejavu:: ops
from dejavu_compile.backend import DejavuOptionError
from dejavu_compile.blocks import MLPBlock, WeightRef
from dejavu_compile.kernels import native
from dejavu_compile.passes.graph_utils import shape_of

log = logging.getLogger("dejavu_compile")


class PlanMismatchError(DejavuOptionError):
    """The plan was made for another model (or another shape of this one)."""


def _placeholder_values(gm: fx.GraphModule, example_inputs) -> dict[fx.Node, torch.Tensor]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return dict(zip(placeholders, example_inputs))


def check_plan_against_blocks(plan, blocks) -> None:
    """Raise :class:`PlanMismatchError` when the plan's entries do not fit the matched blocks."""
    problems = []
    by_key = {(b.layer, b.kind): b for b in blocks}
    for (layer, kind), entry in plan.entries.items():
        block = by_key.get((layer, kind))
        if block is None:
            continue  # the graph may hold only part of the model (graph breaks): checked per graph
        total = block.intermediate_size if isinstance(block, MLPBlock) else block.num_heads
        if entry.total != total:
            problems.append(f"layer {layer} {kind}: plan has {entry.total} {'neurons' if kind == 'mlp' else 'heads'},"
                            f" model has {total}")
        if entry.A is not None:
            width = block.hidden_size if isinstance(block, MLPBlock) else (shape_of(block.nodes.get("input")) or [None])[-1]
            reads = {"glu_int8": entry.A.shape[1], "glu_int4": 2 * entry.A.shape[1]}.get(entry.nonlinearity,
                                                                                          entry.A.shape[0])
            if width is not None and reads != width:
                problems.append(f"layer {layer} {kind}: predictor reads {reads} features, "
                                f"the block input has {width}")
        if entry.nonlinearity in ("glu_int8", "glu_int4") and isinstance(block, MLPBlock) and not block.gated:
            problems.append(f"layer {layer} mlp: quantized gate/up predictor but the block has no gate")
        if entry.values == "predictor" and not entry.dense and entry.nonlinearity != "glu_int8":
            problems.append(f"layer {layer} {kind}: values 'predictor' needs the int8 gate/up predictor, "
                            f"the entry has {entry.nonlinearity!r}")
    layers = {b.layer for b in blocks if b.layer >= 0}  # -1: a graph of one layer's frame (graph break)
    plan_layers = {layer for layer, _ in plan.entries}
    if layers and max(layers) >= plan.num_layers:
        problems.append(f"model has layer {max(layers)} but the plan covers {plan.num_layers} layers")
    if layers and not (layers & plan_layers):
        problems.append("no layer of the model has a plan entry")
    if problems:
        raise PlanMismatchError("sparsity plan does not fit this model: " + "; ".join(problems[:6]))


def _const(gm: fx.GraphModule, graph: fx.Graph, name: str, tensor: torch.Tensor) -> fx.Node:
    """A tensor the rewritten graph needs (predictor weights): an extra trailing graph input.

    Inductor only accepts the parameters Dynamo lifted as get_attr, so new tensors travel as inputs;
    the backend appends their values (``gm.meta["dejavu_extra_inputs"]``) on every call.
    """
    extra = gm.meta.setdefault("dejavu_extra_inputs", [])
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        node = graph.placeholder(name.replace(".", "_"))
    node.meta["example_value"] = tensor
    node.meta["val"] = tensor
    node._dynamo_source = None  # not from user code (AOTAutograd accepts a None source)
    node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}  # static for CUDA graphs
    extra.append(tensor)
    return node


def _rows_view(graph, ref: WeightRef, tensor: torch.Tensor | None) -> fx.Node:
    """The (F, d) rows of a gate/up weight, as a view of the parameter placeholder."""
    node = ref.node
    if ref.layout == "in_out":
        node = graph.call_method("t", (node,))
    if ref.rows is not None:
        node = graph.call_function(operator.getitem, (node, slice(*ref.rows)))
    return node


def _bias_view(graph, ref: WeightRef) -> fx.Node | None:
    if ref.bias_node is None:
        return None
    node = ref.bias_node
    if ref.rows is not None:
        node = graph.call_function(operator.getitem, (node, slice(*ref.rows)))
    return node


def _emit_predictor(gm, graph, entry, x2d: fx.Node, prefix: str, dtype, device) -> fx.Node:
    """Nodes computing the entry's scores from a (B, d) input; weights become graph constants."""
    def const(suffix, t):
        return _const(gm, graph, f"{prefix}_{suffix}", t.detach().to(device=device, dtype=dtype).contiguous())

    if entry.nonlinearity == "glu_int8":
        return graph.call_function(torch.abs, (_emit_int8_values(gm, graph, entry, x2d, prefix, device),))
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
        fn, kwargs = _ACT_FN[_activation_name(entry.activation)]
        g = graph.call_function(fn, (graph.call_function(torch.matmul, (h_gate, const("B_gate", B[:r]))),), kwargs)
        u = graph.call_function(torch.matmul, (h_up, const("B_up", B[r:])))
        return graph.call_function(torch.abs, (graph.call_function(operator.mul, (g, u)),))
    if entry.nonlinearity == "relu":
        h = graph.call_function(torch.relu, (h,))
    scores = graph.call_function(torch.matmul, (h, const("B", B)))
    if entry.b is not None:
        scores = graph.call_function(operator.add, (scores, const("b", entry.b)))
    return scores


def _int8_consts(gm, graph, entry, prefix: str, device) -> tuple[fx.Node, fx.Node]:
    """The int8 predictor's (2F, d) int8 rows and their (2F,) fp32 scales, as graph constants."""
    q = _const(gm, graph, f"{prefix}_A_int8", entry.A.detach().to(device=device).contiguous())
    scale = _const(gm, graph, f"{prefix}_a", entry.a.detach().to(device=device, dtype=torch.float32).contiguous())
    return q, scale


def _emit_int8_values(gm, graph, entry, x2d: fx.Node, prefix: str, device) -> fx.Node:
    """(B, F) act(g~) * u~ of a "glu_int8" entry, signed: its scores' magnitude, and the kept
    neurons' values when the entry's values are "predictor"."""
    q, scale = _int8_consts(gm, graph, entry, prefix, device)
    return _emit_gated(graph, entry, graph.call_function(torch.ops.dejavu.int8_linear.default, (x2d, q, scale)))


def _emit_gated(graph, entry, h: fx.Node) -> fx.Node:
    """act(g~) * u~ from a quantized predictor's (B, 2F) pre-activations [g~, u~]."""
    g = graph.call_function(operator.getitem, (h, (Ellipsis, slice(0, entry.total))))
    u = graph.call_function(operator.getitem, (h, (Ellipsis, slice(entry.total, None))))
    fn, kwargs = _ACT_FN[_activation_name(entry.activation)]
    return graph.call_function(operator.mul, (graph.call_function(fn, (g,), kwargs), u))


def _emit_int4_values(gm, graph, entry, x2d: fx.Node, prefix: str, dtype, device) -> fx.Node:
    """(B, F) act(g~) * u~ of a "glu_int4" entry: its 4-bit codes unpacked and scaled to (2F, d) rows
    in the model's dtype, then one matmul. The constants are the packed codes and fp16 scales; the
    rows are dequantized on every call (no int4 GEMV kernel yet). Spelled out rather than calling
    ``predictors.dequantize_int4`` (same arithmetic, via int8 codes): in SmolLM2 decode steps that
    form ran at 0.32x Inductor dense against this one's 0.51x (`benchmarks/decode.py --skip-synthetic
    --predictors int4 --densities 0.5 --new-tokens 8 --repeats 1`)."""
    packed = _const(gm, graph, f"{prefix}_A_int4", entry.A.detach().to(device=device).contiguous())
    scales = _const(gm, graph, f"{prefix}_a", entry.a.detach().to(device=device).contiguous())
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
        h = graph.call_function(operator.add, (h, _const(gm, graph, f"{prefix}_b",
                                                         entry.b.detach().to(device=device, dtype=dtype).contiguous())))
    return _emit_gated(graph, entry, h)


def _emit_int8_selection(gm, graph, block: MLPBlock, entry, x2d: fx.Node, prefix: str, device):
    """For values "predictor" entries off the fused op: the int8 predictor's signed values (B, F)
    and the ids of the k largest in magnitude (B, k), the values node tagged as the predictor."""
    estimate = _emit_int8_values(gm, graph, entry, x2d, prefix, device)
    estimate.meta["dejavu"] = {"role": "predictor", "layer": block.layer, "kind": "mlp",
                               "reads": block.nodes["input"].name, "lookahead": False}
    top = graph.call_function(torch.topk, (graph.call_function(torch.abs, (estimate,)), entry.k),
                              {"dim": -1, "sorted": False})
    return estimate, graph.call_function(operator.getitem, (top, 1))


def _predictor_values(block: MLPBlock, entry, fallbacks) -> bool:
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


def _activation_name(name: str) -> str:
    return {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}.get(name, name)


_ACT_FN = {
    "silu": (torch.nn.functional.silu, {}),
    "gelu": (torch.nn.functional.gelu, {}),
    "relu": (torch.relu, {}),
    "gelu_tanh": (torch.nn.functional.gelu, {"approximate": "tanh"}),
}


def _previous_input(block: MLPBlock, ordered_blocks) -> fx.Node:
    """The input of the block that runs before ``block`` (its lookahead source)."""
    position = ordered_blocks.index(block)
    own = block.nodes["input"]
    for earlier in reversed(ordered_blocks[:position]):
        if earlier.nodes["input"] is not own:
            return earlier.nodes["input"]
    return own


def _erase_unused(graph: fx.Graph, nodes) -> None:
    nodes = [n for n in dict.fromkeys(nodes) if n is not None and n.graph is graph]
    changed = True
    while changed:
        changed = False
        for node in list(nodes):
            if not node.users and node.op in ("call_function", "call_method"):
                graph.erase_node(node)
                nodes.remove(node)
                changed = True


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


def sparsify(gm: fx.GraphModule, example_inputs, report, opts) -> fx.GraphModule:
    from dejavu_compile.passes.sparsify_attention import rewrite_attention  # it imports this module

    plan = opts["plan"]
    match = report.match
    check_plan_against_blocks(plan, match.blocks)
    if not match.blocks:
        report.dense_reason = "no MLP or attention block matched"
        return gm
    for block in match.blocks:
        if block.layer < 0:
            match.fallbacks.append((block.module, "the graph holds this block without its layer's path (a graph "
                                                  "break inside the model), so no plan entry applies: dense"))
    tokens = {b.tokens for b in match.blocks}
    batch = max(b.batch for b in match.blocks)
    if opts.get("simulate"):
        return _simulate(gm, match, plan, report, example_inputs, opts)
    if tokens != {1}:
        report.dense_reason = f"prefill-shaped graph ({max(tokens)} tokens per sequence): dense"
        return gm
    if batch > opts["max_batch"]:
        report.dense_reason = f"batch {batch} > max_batch {opts['max_batch']}: dense"
        return gm

    values = _placeholder_values(gm, example_inputs)
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    ordered = sorted(match.blocks, key=lambda b: order[b.nodes["input"]] if b.nodes["input"] in order else -1)
    for block in match.mlp:
        entry = plan.entries.get((block.layer, "mlp"))
        if entry is None or entry.dense:
            continue
        if block.activation not in KERNEL_ACTIVATIONS:
            match.fallbacks.append((block.module, f"activation {block.activation!r} has no sparse kernel"))
            continue
        if _predictor_values(block, entry, match.fallbacks):
            _rewrite_mlp_from_predictor(gm, graph, block, entry, values, report, opts)
        else:
            _rewrite_mlp(gm, graph, block, entry, ordered, values, report, opts)
    for block in match.attention:
        entry = plan.entries.get((block.layer, "attention"))
        if entry is not None and not entry.dense:
            rewrite_attention(gm, graph, block, entry, ordered, values, report, match.fallbacks)
    graph.lint()
    gm.recompile()
    return gm


def _insert_selection(gm, graph, block, entry, ordered, values, opts=None):
    """Predictor and top-k, right after the input they read (as early as their inputs allow).
    The int8 predictor on CPU fp32 is one C++ op that scores and selects (``cpu_glu_int8_topk``).

    Returns (flat (tokens, k) neuron or head ids, the node the predictor reads)."""
    x = block.nodes["input"]
    weight_node = block.up.node if isinstance(block, MLPBlock) else block.o.node
    weight_value = values.get(weight_node)
    dtype = weight_value.dtype if weight_value is not None else torch.float32
    device = _value_device(values, weight_node)
    source = _previous_input(block, ordered) if entry.lookahead else x
    prefix = f"dejavu_L{block.layer}_{block.kind}"
    fused = entry.nonlinearity == "glu_int8" and opts is not None and _cpu_lowering(opts, weight_value) == "native"
    with graph.inserting_before(source.next):
        flat_source = graph.call_method("reshape", (source, -1, shape_of(source)[-1]))
        if fused:
            q, scale = _int8_consts(gm, graph, entry, prefix, device)
            scores = idx = graph.call_function(torch.ops.dejavu.cpu_glu_int8_topk.default,
                                               (flat_source, q, scale, entry.k, _activation_name(entry.activation)))
        else:
            scores = _emit_predictor(gm, graph, entry, flat_source, prefix, dtype, device)
            top = graph.call_function(torch.topk, (scores, entry.k), {"dim": -1, "sorted": False})
            idx = graph.call_function(operator.getitem, (top, 1))
    for node in dict.fromkeys((scores, idx)):  # one node when the op fuses both: it is the predictor
        node.meta["dejavu"] = {"role": "predictor" if node is scores else "topk", "layer": block.layer,
                               "kind": block.kind, "reads": source.name, "lookahead": source is not x}
    return idx, source


def _value_device(values, node) -> torch.device:
    """The device of a weight placeholder's example value (CPU when it has none)."""
    value = values.get(node)
    return value.device if value is not None else torch.device("cpu")


def _simulate(gm, match, plan, report, example_inputs, opts) -> fx.GraphModule:
    """Masked dense simulation: the same predictors and top-k, applied as a 0/1 mask on the
    activations before the dense down projection (on the attention output for heads). Exact per
    token, any number of tokens (so it evaluates perplexity in one prefill pass); reads every
    weight, so it is not faster."""
    from dejavu_compile.passes.sparsify_attention import simulate_attention

    values = _placeholder_values(gm, example_inputs)
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    ordered = sorted(match.blocks, key=lambda b: order.get(b.nodes["input"], -1))
    for block in match.mlp:
        entry = plan.entries.get((block.layer, "mlp"))
        if entry is None or entry.dense:
            continue
        hidden = block.nodes["hidden"]
        from_predictor = _predictor_values(block, entry, match.fallbacks)
        if from_predictor:  # the predictor's own values, masked: what cpu_glu_int8_mlp sums
            x = block.nodes["input"]
            with graph.inserting_before(hidden.next):
                x2d = graph.call_method("reshape", (x, -1, shape_of(x)[-1]))
                estimate, idx = _emit_int8_selection(gm, graph, block, entry, x2d, f"dejavu_L{block.layer}_mlp",
                                                     _value_device(values, block.up.node))
        else:
            idx, _ = _insert_selection(gm, graph, block, entry, ordered, values, opts)
        with graph.inserting_before(idx.next if from_predictor else hidden.next):  # after idx and hidden
            flat = graph.call_method("reshape", (hidden, -1, block.intermediate_size))
            kept = graph.call_method("type_as", (estimate, flat)) if from_predictor else flat
            zeros = graph.call_function(torch.zeros_like, (flat,))
            ones = graph.call_function(torch.ones_like, (idx,), {"dtype": _dtype_of(values, block)})
            mask = graph.call_function(torch.scatter, (zeros, -1, idx, ones))
            masked_flat = graph.call_function(operator.mul, (kept, mask))
            masked = graph.call_method("view_as", (masked_flat, hidden))
        hidden.replace_all_uses_with(masked, delete_user_cb=lambda user: user not in (flat, masked))
        report.rewritten.append(f"layer {block.layer} mlp: masked simulation, {entry.k}/{entry.total} neurons"
                                f"{', values from the int8 predictor' if from_predictor else ''}")
    for block in match.attention:
        entry = plan.entries.get((block.layer, "attention"))
        if entry is not None and not entry.dense:
            simulate_attention(gm, graph, block, entry, ordered, values, report)
    graph.lint()
    gm.recompile()
    return gm


def _dtype_of(values, block: MLPBlock):
    weight = values.get(block.up.node)
    return weight.dtype if weight is not None else torch.float32


def _cpu_lowering(opts, weight, rows_contiguous: bool = True) -> str | None:
    """How a CPU sparse MLP is lowered: "native" (the C++ ops of kernels/cpu_ops.cpp, called straight
    from Inductor's wrapper), "decomposed" (aten gathers that Inductor fuses) or "op" (the public
    custom op); None off the CPU (the custom op, Triton on CUDA).

    "auto" takes "native" for fp32 weights when the C++ ops build, else "decomposed" under Inductor
    and "op" under eager; so does a block whose weight rows are not contiguous (GPT-2's Conv1D
    (in, out) weights), which the C kernel cannot read. Measured inside SmolLM2 decode steps, a custom op with a Python kernel
    costs ~140 us a call and torch.topk ~55 us with the caches a step leaves, which is what made
    the op and the decomposed form lose to dense there (benchmarks/README.md)."""
    if weight is not None and weight.device.type != "cpu":
        return None
    choice = opts.get("cpu_lowering", "auto")
    fp32 = weight is None or weight.dtype == torch.float32
    if choice in ("auto", "native") and fp32 and rows_contiguous and native.load_ops():
        return "native"
    if choice == "auto":
        return "decomposed" if opts["inner"] == "inductor" else "op"
    return "op" if choice == "native" else choice


def _unit_stride_rows(ref: WeightRef, value) -> bool:
    """Whether the (F, d) rows view of a projection's weight has contiguous rows (what the C kernel reads)."""
    return ref.layout != "in_out" and value is not None and value.stride(-1) == 1


def _emit_decomposed(graph, block, x2d, idx, k, w_gate, b_gate, w_up, b_up, w_down_t, b_down) -> fx.Node:
    """sum_j act(w_gate[j].x) * (w_up[j].x) * w_down_t[j] over j in idx, as plain aten ops that
    Inductor schedules in one graph (no per-layer op call): it turns the one-column bmm into a
    reduction and fuses the index_select into it (one loop reading the selected gate/up rows in
    place, nothing copied), and the down projection is a weighted row sum read in place
    (embedding_bag). Measured fastest of the forms tried on CPU."""
    flat_idx = graph.call_method("reshape", (idx, -1))
    xb = graph.call_method("unsqueeze", (x2d, -1))  # (B, d, 1)

    def project(weight, bias):
        return _gather_gemv(graph, weight, bias, idx, flat_idx, xb)

    fn, kwargs = _ACT_FN[block.activation]
    if block.gated:
        hidden = graph.call_function(operator.mul, (graph.call_function(fn, (project(w_gate, b_gate),), kwargs),
                                                    project(w_up, b_up)))
    else:
        hidden = graph.call_function(fn, (project(w_up, b_up),), kwargs)
    return _weighted_row_sum(graph, idx, hidden, k, w_down_t, b_down)


def _gather_gemv(graph, weight, bias, idx, flat_idx, xb) -> fx.Node:
    """(B, n) = weight[idx[b]] . x_b (+ bias[idx]): index_select + one-column bmm, which Inductor on
    CPU fuses into one loop reading the selected rows in place."""
    rows = graph.call_function(torch.index_select, (weight, 0, flat_idx))  # (B*n, d)
    rows = graph.call_method("view", (rows, -1, _size(graph, idx, -1), _size(graph, weight, 1)))  # (B, n, d)
    value = graph.call_method("squeeze", (graph.call_function(torch.bmm, (rows, xb)), -1))  # (B, n)
    if bias is not None:
        value = graph.call_function(operator.add, (value, graph.call_function(operator.getitem, (bias, idx))))
    return value


def _weighted_row_sum(graph, idx, weights, n, table, bias) -> fx.Node:
    """(B, out) = sum_j weights[b, j] * table[idx[b, j]] (+ bias): embedding_bag, rows read in place.

    One bag per row runs on one thread: each row's n ids are cut into `bags` bags (summed after), so
    the row sums run on all cores (SmolLM2 MLP shapes, 2 threads: 104 -> 59 us per layer at n=768).
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
        out = graph.call_method("sum", (graph.call_method("view", (out, -1, bags, _size(graph, table, 1))), 1))
    if bias is not None:
        out = graph.call_function(operator.add, (out, bias))
    return out


def _size(graph, node, dim) -> fx.Node:
    return graph.call_method("size", (node, dim))


def _transposed_weight(gm, graph, ref: WeightRef, value, name: str, report, what: str) -> fx.Node:
    """A projection's weight as (in, out) rows, one contiguous row per input feature."""
    if ref.layout == "in_out":  # Conv1D is (in, out): already the transposed layout
        return ref.node
    if value is not None and value.t().is_contiguous():
        return graph.call_method("t", (ref.node,))  # stored transposed: a free view
    report.rewritten.append(f"{what} weight copied transposed "
                            "(call dejavu_compile.prepare_model(model) to avoid the copy)")
    return _const(gm, graph, name, value.detach().t().contiguous())


def _rewrite_mlp(gm, graph, block: MLPBlock, entry, ordered, values, report, opts) -> None:
    x = block.nodes["input"]
    prefix = f"dejavu_L{block.layer}_mlp"
    idx, source = _insert_selection(gm, graph, block, entry, ordered, values, opts)

    # 2. The sparse op in place of the block.
    down_value = values.get(block.down.node)
    with graph.inserting_before(block.nodes["down"]):
        x2d = graph.call_method("reshape", (x, -1, shape_of(x)[-1]))
        w_down_t = _transposed_weight(gm, graph, block.down, down_value, f"{prefix}_w_down_t", report,
                                      f"layer {block.layer} mlp: down")
        b_down = block.down.bias_node
        w_up = _rows_view(graph, block.up, values.get(block.up.node))
        b_up = _bias_view(graph, block.up)
        w_gate = _rows_view(graph, block.gate, values.get(block.gate.node)) if block.gated else None
        b_gate = _bias_view(graph, block.gate) if block.gated else None
        refs = (block.gate, block.up) if block.gated else (block.up,)
        lowering = _cpu_lowering(opts, values.get(block.up.node),
                                 all(_unit_stride_rows(ref, values.get(ref.node)) for ref in refs))
        if lowering == "native":  # the C kernel's (w_a, w_b): (gate, up), or (up, None) for a plain MLP
            w_a, b_a, w_b, b_b = (w_gate, b_gate, w_up, b_up) if block.gated else (w_up, b_up, None, None)
            out = graph.call_function(torch.ops.dejavu.cpu_sparse_mlp.default,
                                      (x2d, w_a, w_b, w_down_t, idx, block.activation, b_a, b_b, b_down))
        elif lowering == "decomposed":
            out = _emit_decomposed(graph, block, x2d, idx, entry.k, w_gate, b_gate, w_up, b_up, w_down_t, b_down)
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
    _erase_unused(graph, _mlp_region_nodes(block))


def _rewrite_mlp_from_predictor(gm, graph, block: MLPBlock, entry, values, report, opts) -> None:
    """The block from its int8 predictor's values (entry.values == "predictor"): act(g~) * u~ for
    every neuron, the top k by magnitude, and those k values times their rows of the transposed
    down weight. The fp32 gate and up weights are not read. On CPU fp32 with the C++ ops all of it
    is one call (``dejavu::cpu_glu_int8_mlp``); elsewhere aten ops (int8_linear, topk, gather,
    embedding_bag)."""
    x = block.nodes["input"]
    prefix = f"dejavu_L{block.layer}_mlp"
    down_value = values.get(block.down.node)
    device = _value_device(values, block.down.node)
    with graph.inserting_before(block.nodes["down"]):
        x2d = graph.call_method("reshape", (x, -1, shape_of(x)[-1]))
        w_down_t = _transposed_weight(gm, graph, block.down, down_value, f"{prefix}_w_down_t", report,
                                      f"layer {block.layer} mlp: down")
        b_down = block.down.bias_node
        if _cpu_lowering(opts, down_value) == "native":  # fp32 on CPU with the C++ ops
            q, scale = _int8_consts(gm, graph, entry, prefix, device)
            both = graph.call_function(torch.ops.dejavu.cpu_glu_int8_mlp.default,
                                       (x2d, q, scale, w_down_t, entry.k, _activation_name(entry.activation), b_down))
            both.meta["dejavu"] = {"role": "predictor", "layer": block.layer, "kind": "mlp", "reads": x.name,
                                   "lookahead": False}
            out = graph.call_function(operator.getitem, (both, 0))
        else:
            estimate, idx = _emit_int8_selection(gm, graph, block, entry, x2d, prefix, device)
            kept = graph.call_function(torch.gather, (estimate, -1, idx))
            out = _weighted_row_sum(graph, idx, kept, entry.k, w_down_t, b_down)
        out.meta["dejavu"] = {"role": "sparse_mlp", "layer": block.layer, "k": entry.k}
    _replace_block(graph, block, out)
    report.rewritten.append(f"layer {block.layer} mlp: {entry.k}/{entry.total} neurons, values from the int8 "
                            "predictor (down rows only)")


def prepare_model(model, *example_args, **example_kwargs) -> list[str]:
    """Store each matched MLP's down-projection weight and each attention block's output-projection
    weight transposed, in place (values unchanged).

    The sparse kernels read a neuron's down weights (a head's output weights) as contiguous rows of
    ``W^T``; with the parameter stored that way the compiled graph uses a free view instead of holding
    a transposed copy. Dense ``F.linear`` reads the transposed storage just as fast. Call before compiling.
    Returns the names of the parameters re-laid out. Without example inputs, two token ids are used.
    """
    from dejavu_compile.explain import explain

    if not example_args and not example_kwargs:
        device = next(model.parameters()).device
        example_args = (torch.tensor([[1, 2]], device=device),)
    report = explain(model, *example_args, **example_kwargs)
    params = dict(model.named_parameters())
    changed = []
    for block in report.blocks:
        ref = block.down if isinstance(block, MLPBlock) else block.o
        if ref.layout != "out_in":
            continue
        param = params.get(ref.name)
        if param is None or param.t().is_contiguous():
            continue
        with torch.no_grad():
            param.data = param.data.t().contiguous().t()
        changed.append(ref.name)
    torch._dynamo.reset()  # graphs traced before were specialised on the old strides
    return changed
