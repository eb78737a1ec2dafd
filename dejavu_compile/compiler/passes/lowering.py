"""The kernel table: the one place every pass that emits a kernel asks which.

A :class:`KernelLowering` says where it runs (device types, dtypes, an availability check), its
priority, and how it writes each role it fills into the graph (``ROLE_HOOKS``): the sparse MLP
(``emit_mlp``), the int8 predictor's scoring and top-k (``emit_int8_topk``), the whole block from
the int8 predictor's values (``emit_int8_values_mlp``), the dense decode GEMV (``emit_linear``,
pass ``dense_linear``) and its form for sibling projections of one input (``emit_linear_cat``), the
screened output head (``emit_screened_linear``, pass ``head_screen``) and
decode-step attention (``emit_decode_attention``, pass ``decode_attention``). A role no applicable
entry fills keeps its aten form. A new backend is one folder of kernels (registering
``torch.ops.dejavu.*``) plus one :func:`register_lowering`.

Built-in entries:

- ``native``: the C++ ops of the kernels package (``torch.ops.dejavu.cpu_sparse_mlp``,
  ``cpu_glu_int8_topk``, ``cpu_glu_int8_mlp``, ``cpu_linear``, ``cpu_linear_cat``,
  ``cpu_q8_linear_cat``, ``cpu_screened_linear``,
  ``cpu_decode_attention``), CPU fp32, bf16 or fp16 (weights read as stored,
  sums in fp32), weight rows contiguous; called straight from Inductor's wrapper code, no Python
  per call.
- ``decomposed``: aten gathers and ``embedding_bag`` that Inductor fuses into the decode step's
  kernels (CPU).
- ``op``: the public custom ops ``torch.ops.dejavu.sparse_gated_mlp`` / ``sparse_mlp`` (any device:
  torch code on CPU, Triton on CUDA).
- ``triton``: the same custom ops on CUDA; on CPU tensors the Triton launchers themselves, under
  the Triton interpreter (``TRITON_INTERPRET=1``) and ``inner="eager"`` only (a check of the
  kernels inside a whole model, not a fast path).

With ``cpu_lowering="auto"`` a CPU model in fp32, bf16 or fp16 takes ``native`` where the C++ ops
build, else ``decomposed`` under Inductor and ``op`` under eager (aten in the model's dtype). The
int8 predictor scores in fp32 in a model of any dtype (its input cast to fp32, as calibration
scores it), fused with top-k (``cpu_glu_int8_topk``), and with the block for values "predictor"
(``cpu_glu_int8_mlp``, reading the model's down rows or the plan's bf16 copy of an fp32 model's).

On CUDA every dtype takes ``triton`` (the custom ops' fp16/bf16/fp32 Triton kernels). Dense
layers, attention and everything outside the sparse blocks stay in the model's dtype.

The choice (:func:`choose_lowering`): the entry of highest priority that applies to the block
(:func:`preference`); ``cpu_lowering`` names the CPU entry to use instead of the automatic one, and
``lowering`` forces one entry by name. A registered entry takes part with no other edit.
"""
from __future__ import annotations

import importlib.util
import logging
import operator
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.fx as fx

from dejavu_compile import activations, kernels  # kernels: also registers the dejavu:: ops
from dejavu_compile.compiler.blocks import MLPBlock, WeightRef
from dejavu_compile.compiler.passes.graph_build import emit_gather_gemv, emit_weighted_row_sum
from dejavu_compile.compiler.passes.predictor_graph import int8_constants
from dejavu_compile.errors import DejavuOptionError

log = logging.getLogger("dejavu_compile")


@dataclass
class SparseMLPNodes:
    """The graph values a sparse MLP lowering reads: x2d (tokens, d); idx (tokens, k) neuron ids;
    gate/up as (F, d) row views (gate None for a plain MLP); w_down_t (F, d_out)."""

    block: MLPBlock
    x2d: fx.Node
    idx: fx.Node
    k: int
    w_gate: Optional[fx.Node]
    b_gate: Optional[fx.Node]
    w_up: fx.Node
    b_up: Optional[fx.Node]
    w_down_t: fx.Node
    b_down: Optional[fx.Node]
    device: torch.device  # of the weights


class EmitInt8TopK(Protocol):
    def __call__(self, gm: fx.GraphModule, graph: fx.Graph, entry, x2d: fx.Node, prefix: str,
                 device: torch.device) -> fx.Node:
        """The int8 predictor's scores and top k in one op: (tokens, k) neuron ids."""


class EmitInt8ValuesMLP(Protocol):
    def __call__(self, gm: fx.GraphModule, graph: fx.Graph, block: MLPBlock, entry, x2d: fx.Node,
                 w_down_t: fx.Node, b_down: Optional[fx.Node], prefix: str,
                 device: torch.device) -> tuple[fx.Node, fx.Node]:
        """The whole block from the int8 predictor's values: (output node, predictor node)."""


class EmitLinear(Protocol):
    def __call__(self, graph: fx.Graph, x: fx.Node, weight: fx.Node, bias: Optional[fx.Node]) -> fx.Node:
        """A dense projection of x (..., d) by weight (n, d) (one unit stride): (..., n)."""


class EmitLinearCat(Protocol):
    def __call__(self, graph: fx.Graph, x: fx.Node, weights: list[fx.Node], scales: Optional[list[fx.Node]],
                 bias: Optional[fx.Node]) -> fx.Node:
        """Several projections of the same x (..., d), their outputs concatenated: (..., sum n_i).
        weights (n_i, d) with unit-stride rows in x's dtype, or int8 with their group scales
        (quantize_weights' format) when scales is given; bias the concatenated bias or None."""


class EmitScreenedLinear(Protocol):
    def __call__(self, graph: fx.Graph, x: fx.Node, weight: fx.Node, q: fx.Node, scale: fx.Node, k: int,
                 bias: Optional[fx.Node]) -> fx.Node:
        """The output head screened by its int8 rows q (n, d) and scales (n,): every output estimated,
        the top k of each row exact from weight (n, d): (..., n)."""


class EmitDecodeAttention(Protocol):
    def __call__(self, graph: fx.Graph, q: fx.Node, k: fx.Node, v: fx.Node, attn_mask: Optional[fx.Node],
                 scale: Optional[float]) -> fx.Node:
        """scaled_dot_product_attention of a few query rows q (B, H, L, D) over a key/value cache
        k, v (B, H_kv, S, D), H a multiple of H_kv (query head h reads key/value head h // (H / H_kv),
        SDPA's enable_gqa), without dropout or causal flag: (B, H, L, D)."""


# The roles a kernel table entry may fill, and the hook that fills each.
ROLE_HOOKS = {"mlp": "emit_mlp", "int8_topk": "emit_int8_topk", "int8_values_mlp": "emit_int8_values_mlp",
              "linear": "emit_linear", "linear_cat": "emit_linear_cat", "screened_head": "emit_screened_linear",
              "decode_attention": "emit_decode_attention"}


@dataclass(frozen=True)
class KernelLowering:
    """One kernel backend's entry in the table: where it runs, its priority, and a hook per role it
    fills (``ROLE_HOOKS``: the sparse MLP, the int8 predictor's scores + top-k, the whole MLP from the
    int8 predictor's values, the dense GEMV, sibling projections' GEMV in one call, the screened output
    head, decode attention). Among the entries that apply
    to a block, the automatic choice takes the highest ``priority``; ``automatic=False`` entries run
    only when the ``lowering`` option names them, and ``auto_inner`` limits the automatic choice to
    some inner compilers. ``cpp_wrapper``: its ops are C++ ops that Inductor's C++ wrapper calls with
    no Python between them (the backend compiles a graph holding any with that wrapper)."""

    name: str
    device_types: tuple[str, ...]
    dtypes: Optional[tuple[torch.dtype, ...]]  # None: any floating dtype
    is_available: Callable[[dict, str], bool]  # (backend options, device type) -> whether it can run here
    emit_mlp: Optional[Callable[[fx.Graph, SparseMLPNodes], fx.Node]]  # -> (tokens, d_out)
    priority: int = 0
    automatic: bool = True
    auto_inner: Optional[tuple[str, ...]] = None  # inner compilers it is chosen automatically under (None: any)
    needs_contiguous_rows: bool = False  # gate/up rows must have unit stride (not Conv1D's (in, out))
    emit_int8_topk: Optional[EmitInt8TopK] = None
    emit_int8_values_mlp: Optional[EmitInt8ValuesMLP] = None
    emit_linear: Optional[EmitLinear] = None
    emit_linear_cat: Optional[EmitLinearCat] = None
    emit_screened_linear: Optional[EmitScreenedLinear] = None
    emit_decode_attention: Optional[EmitDecodeAttention] = None
    cpp_wrapper: bool = False

    def fills(self, role: str) -> bool:
        return getattr(self, ROLE_HOOKS[role]) is not None

    def use(self, gm: fx.GraphModule, role: str):
        """The hook for ``role``, noting in ``gm.meta["dejavu_kernels"]`` that the graph holds this entry's ops."""
        self.note(gm)
        return getattr(self, ROLE_HOOKS[role])

    def note(self, gm: fx.GraphModule) -> None:
        """Note in ``gm.meta["dejavu_kernels"]`` that the graph holds this entry's ops (also those the
        model's own code calls, such as ``quantize_weights``' int8 projections)."""
        gm.meta.setdefault("dejavu_kernels", set()).add(self.name)

    def applies(self, opts: dict, weight: Optional[torch.Tensor], rows_contiguous: bool = True,
                dtype: Optional[torch.dtype] = None) -> bool:
        """Whether this lowering can take a block whose up weight is ``weight`` (its example value),
        computing in ``dtype`` (default: the weight's)."""
        device = weight.device.type if weight is not None else "cpu"
        dtype = dtype or (weight.dtype if weight is not None else torch.float32)
        return (device in self.device_types and (self.dtypes is None or dtype in self.dtypes)
                and (rows_contiguous or not self.needs_contiguous_rows) and self.is_available(opts, device))


_LOWERINGS: dict[str, KernelLowering] = {}


def register_lowering(lowering: KernelLowering, *, replace: bool = False) -> KernelLowering:
    if lowering.name in _LOWERINGS and not replace:
        raise ValueError(f"a kernel lowering named {lowering.name!r} is already registered (pass replace=True)")
    _LOWERINGS[lowering.name] = lowering
    return lowering


def unregister_lowering(name: str) -> KernelLowering:
    return _LOWERINGS.pop(name)


def registered_lowerings() -> dict[str, KernelLowering]:
    return dict(_LOWERINGS)


def lowering_named(name: str) -> KernelLowering:
    if name not in _LOWERINGS:
        raise DejavuOptionError(f"no kernel lowering named {name!r}; registered: {sorted(_LOWERINGS)}")
    return _LOWERINGS[name]


def cpu_lowering_names() -> tuple[str, ...]:
    """The values the ``cpu_lowering`` option takes: "auto" and each registered entry that runs on
    CPU tensors (one that cannot run here falls back to the next that can, as under "auto")."""
    return ("auto", *sorted(n for n, e in _LOWERINGS.items() if "cpu" in e.device_types))


def preference(opts: dict) -> tuple[str, ...]:
    """The lowerings to try, first that applies wins, by priority. ``lowering`` forces one entry;
    ``cpu_lowering`` other than "auto" replaces the automatic CPU-only entries by the one it names
    (entries that also run off the CPU stay, so a CUDA model still gets its kernels)."""
    forced = opts.get("lowering")
    if forced is not None:
        return (forced,)
    choice = opts.get("cpu_lowering", "auto")
    inner = opts.get("inner", "inductor")
    ranked = sorted(_LOWERINGS.values(), key=lambda e: -e.priority)
    if choice == "auto":
        return tuple(e.name for e in ranked
                     if e.automatic and (e.auto_inner is None or inner in e.auto_inner))
    return tuple(e.name for e in ranked
                 if e.name == choice or (e.automatic and e.device_types != ("cpu",)))


def choose_lowering(opts: dict, weight: Optional[torch.Tensor], rows_contiguous: bool = True,
                    dtype: Optional[torch.dtype] = None) -> KernelLowering:
    """The kernel lowering for a sparse MLP whose up weight is ``weight`` (see :func:`preference`);
    ``dtype`` overrides the weight's (the int8 predictor computes in fp32 in a model of any dtype).
    Its int8 hooks, where it has them, fuse the int8 predictor; otherwise the aten forms run."""
    names = preference(opts)
    for name in names:
        lowering = lowering_named(name)
        if lowering.fills("mlp") and lowering.applies(opts, weight, rows_contiguous, dtype):
            return lowering
    device = weight.device.type if weight is not None else "cpu"
    dtype = dtype or (weight.dtype if weight is not None else torch.float32)
    raise DejavuOptionError(f"kernel lowering {names[0]!r} cannot run here (device {device}, "
                            f"inner={opts.get('inner', 'inductor')!r}, dtype {dtype})")


def dense_kernel(role: str, opts: dict, weight: Optional[torch.Tensor]) -> KernelLowering | None:
    """The entry of highest priority that fills a dense role ("linear", "screened_head",
    "decode_attention") for this weight (for attention: the query, whose device and dtype decide),
    among the automatic ones (``lowering`` and ``cpu_lowering`` choose the sparse MLP's
    kernels only; ``dense_lowering="aten"`` turns the dense roles off); None: the traced op stays."""
    for entry in sorted(_LOWERINGS.values(), key=lambda e: -e.priority):
        if entry.automatic and entry.fills(role) and entry.applies(opts, weight):
            return entry
    return None


def holds_cpp_wrapper_kernels(gm: fx.GraphModule) -> bool:
    """Whether the graph holds ops of an entry that asks for Inductor's C++ wrapper."""
    return any(_LOWERINGS[name].cpp_wrapper for name in gm.meta.get("dejavu_kernels", ()) if name in _LOWERINGS)


def cpu_lowering(opts, weight, rows_contiguous: bool = True) -> str | None:
    """The name of the CPU lowering a sparse MLP gets ("native", "decomposed" or "op"); None off the
    CPU (the custom op, which runs Triton on CUDA)."""
    if weight is not None and weight.device.type != "cpu":
        return None
    return choose_lowering(opts, weight, rows_contiguous).name


def unit_stride_rows(ref: WeightRef, value) -> bool:
    """Whether the (F, d) rows view of a projection's weight has contiguous rows (what the C kernel reads)."""
    return ref.layout != "in_out" and value is not None and value.stride(-1) == 1


# ---------------------------------------------------------------------------------------------
# availability


def cpu_ops_available(opts: dict, device: str) -> bool:
    """Whether the C++ ops (``torch.ops.dejavu.cpu_*``) are built and registered (builds them once)."""
    return kernels.cpu_ops_available()


def triton_interpreted() -> bool:
    """Whether Triton kernels run on CPU tensors here: TRITON_INTERPRET=1 was set before the
    launchers were imported (importing them earlier without it fixes them to compiled kernels)."""
    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        return False
    from dejavu_compile.kernels.triton import mlp as triton_mlp

    return bool(triton_mlp.interpreted())


def triton_available(opts: dict, device: str) -> bool:
    """CUDA: Triton is installed. CPU tensors (the interpreter) only when asked for by name under
    inner="eager": the graph then calls the launchers as plain functions, which Inductor cannot trace."""
    if device == "cuda":
        return kernels.triton_available()
    return opts.get("lowering") == "triton" and opts.get("inner") == "eager" and triton_interpreted()


# ---------------------------------------------------------------------------------------------
# emitters


def emit_custom_op(graph, m: SparseMLPNodes) -> fx.Node:
    """``dejavu::sparse_gated_mlp`` / ``sparse_mlp`` (check_idx=False: the ids come from topk)."""
    if m.block.gated:
        return graph.call_function(torch.ops.dejavu.sparse_gated_mlp.default,
                                   (m.x2d, m.w_gate, m.w_up, m.w_down_t, m.idx, m.block.activation,
                                    m.b_gate, m.b_up, m.b_down, False))
    return graph.call_function(torch.ops.dejavu.sparse_mlp.default,
                               (m.x2d, m.w_up, m.b_up, m.w_down_t, m.b_down, m.idx, m.block.activation, False))


def emit_native(graph, m: SparseMLPNodes) -> fx.Node:
    """``dejavu::cpu_sparse_mlp``: the C kernel's (w_a, w_b) are (gate, up), or (up, None) for a plain MLP."""
    w_a, b_a, w_b, b_b = (m.w_gate, m.b_gate, m.w_up, m.b_up) if m.block.gated else (m.w_up, m.b_up, None, None)
    return graph.call_function(torch.ops.dejavu.cpu_sparse_mlp.default,
                               (m.x2d, w_a, w_b, m.w_down_t, m.idx, m.block.activation, b_a, b_b, m.b_down))


def emit_native_int8_topk(gm, graph, entry, x2d, prefix, device) -> fx.Node:
    q, scale = int8_constants(gm, graph, entry, prefix, device)
    return graph.call_function(torch.ops.dejavu.cpu_glu_int8_topk.default,
                               (x2d, q, scale, entry.k, activations.canonical(entry.activation)))


def emit_native_int8_values_mlp(gm, graph, block, entry, x2d, w_down_t, b_down, prefix, device):
    """w_down_t: the model's down rows (in its dtype) or the plan's bf16 copy of fp32 ones."""
    q, scale = int8_constants(gm, graph, entry, prefix, device)
    both = graph.call_function(torch.ops.dejavu.cpu_glu_int8_mlp.default,
                               (x2d, q, scale, w_down_t, entry.k, activations.canonical(entry.activation), b_down))
    return graph.call_function(operator.getitem, (both, 0)), both


def emit_native_linear(graph, x, weight, bias) -> fx.Node:
    return graph.call_function(torch.ops.dejavu.cpu_linear.default, (x, weight, bias))


def emit_native_linear_cat(graph, x, weights, scales, bias) -> fx.Node:
    if scales is None:
        return graph.call_function(torch.ops.dejavu.cpu_linear_cat.default, (x, list(weights), bias))
    return graph.call_function(torch.ops.dejavu.cpu_q8_linear_cat.default, (x, list(weights), list(scales), bias))


def emit_native_screened_linear(graph, x, weight, q, scale, k, bias) -> fx.Node:
    return graph.call_function(torch.ops.dejavu.cpu_screened_linear.default, (x, weight, q, scale, k, bias))


def emit_native_decode_attention(graph, q, k, v, attn_mask, scale) -> fx.Node:
    return graph.call_function(torch.ops.dejavu.cpu_decode_attention.default, (q, k, v, attn_mask, scale))


def emit_decomposed(graph, m: SparseMLPNodes) -> fx.Node:
    """sum_j act(w_gate[j].x) * (w_up[j].x) * w_down_t[j] over j in idx, as plain aten ops that
    Inductor schedules in one graph (no per-layer op call): it turns the one-column bmm into a
    reduction and fuses the index_select into it (one loop reading the selected gate/up rows in
    place, nothing copied), and the down projection is a weighted row sum read in place
    (embedding_bag)."""
    flat_idx = graph.call_method("reshape", (m.idx, -1))
    xb = graph.call_method("unsqueeze", (m.x2d, -1))  # (B, d, 1)

    def project(weight, bias):
        return emit_gather_gemv(graph, weight, bias, m.idx, flat_idx, xb)

    fn = activations.torch_fn(m.block.activation)
    if m.block.gated:
        hidden = graph.call_function(operator.mul, (graph.call_function(fn, (project(m.w_gate, m.b_gate),)),
                                                    project(m.w_up, m.b_up)))
    else:
        hidden = graph.call_function(fn, (project(m.w_up, m.b_up),))
    return emit_weighted_row_sum(graph, m.idx, hidden, m.k, m.w_down_t, m.b_down)


def emit_triton(graph, m: SparseMLPNodes) -> fx.Node:
    """The custom op (Triton on CUDA); on CPU tensors the interpreted Triton launchers, called from
    the graph as plain functions (hence eager only: Inductor cannot trace a kernel launch on CPU)."""
    if m.device.type != "cpu":
        return emit_custom_op(graph, m)
    from dejavu_compile.kernels.triton import mlp as triton_mlp

    if m.block.gated:
        return graph.call_function(triton_mlp.sparse_gated_mlp_triton,
                                   (m.x2d, m.w_gate, m.w_up, m.w_down_t, m.idx, m.block.activation,
                                    m.b_gate, m.b_up, m.b_down), {"check": False})
    return graph.call_function(triton_mlp.sparse_mlp_triton,
                               (m.x2d, m.w_up, m.b_up, m.w_down_t, m.b_down, m.idx, m.block.activation),
                               {"check": False})


def always(opts: dict, device: str) -> bool:
    return True


# Under Inductor the decomposed form beats the custom op on CPU (the op's Python call per layer would
# cost more than it saves); under eager the custom op is the faster of the two.
register_lowering(KernelLowering("triton", ("cuda", "cpu"), None, triton_available, emit_triton, priority=40))
register_lowering(KernelLowering("native", ("cpu",), (torch.float32, torch.bfloat16, torch.float16), cpu_ops_available,
                                 emit_native, priority=30, needs_contiguous_rows=True,
                                 emit_int8_topk=emit_native_int8_topk,
                                 emit_int8_values_mlp=emit_native_int8_values_mlp,
                                 emit_linear=emit_native_linear, emit_linear_cat=emit_native_linear_cat,
                                 emit_screened_linear=emit_native_screened_linear,
                                 emit_decode_attention=emit_native_decode_attention, cpp_wrapper=True))
register_lowering(KernelLowering("decomposed", ("cpu",), None, always, emit_decomposed, priority=20,
                                 auto_inner=("inductor",)))
register_lowering(KernelLowering("op", ("cpu", "cuda"), None, always, emit_custom_op, priority=10))
