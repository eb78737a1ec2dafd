"""Which kernel a CPU sparse MLP is lowered to, and the decomposed (aten) form."""
from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from dejavu_compile import activations
from dejavu_compile.compiler.blocks import WeightRef
from dejavu_compile.compiler.passes.graph_build import emit_gather_gemv, emit_weighted_row_sum
from dejavu_compile.kernels import native

log = logging.getLogger("dejavu_compile")


def cpu_lowering(opts, weight, rows_contiguous: bool = True) -> str | None:
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


def unit_stride_rows(ref: WeightRef, value) -> bool:
    """Whether the (F, d) rows view of a projection's weight has contiguous rows (what the C kernel reads)."""
    return ref.layout != "in_out" and value is not None and value.stride(-1) == 1


def emit_decomposed(graph, block, x2d, idx, k, w_gate, b_gate, w_up, b_up, w_down_t, b_down) -> fx.Node:
    """sum_j act(w_gate[j].x) * (w_up[j].x) * w_down_t[j] over j in idx, as plain aten ops that
    Inductor schedules in one graph (no per-layer op call): it turns the one-column bmm into a
    reduction and fuses the index_select into it (one loop reading the selected gate/up rows in
    place, nothing copied), and the down projection is a weighted row sum read in place
    (embedding_bag). Measured fastest of the forms tried on CPU."""
    flat_idx = graph.call_method("reshape", (idx, -1))
    xb = graph.call_method("unsqueeze", (x2d, -1))  # (B, d, 1)

    def project(weight, bias):
        return emit_gather_gemv(graph, weight, bias, idx, flat_idx, xb)

    fn = activations.torch_fn(block.activation)
    if block.gated:
        hidden = graph.call_function(operator.mul, (graph.call_function(fn, (project(w_gate, b_gate),)),
                                                    project(w_up, b_up)))
    else:
        hidden = graph.call_function(fn, (project(w_up, b_up),))
    return emit_weighted_row_sum(graph, idx, hidden, k, w_down_t, b_down)

