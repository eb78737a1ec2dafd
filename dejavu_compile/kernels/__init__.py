"""Sparse kernels for Deja Vu decoding, registered as ``torch.library`` ops in namespace ``dejavu``.

Ops (each with a fake kernel; CUDA runs Triton, ``triton/``; CPU runs torch code, ``torch_impl.py``,
and for the fp32 MLP ops a C kernel built on first use, ``cpu/``):
- ``sparse_gated_mlp(x, w_gate, w_up, w_down_t, idx, activation, b_gate=None, b_up=None, b_down=None, check_idx=True)``
- ``sparse_mlp(x, w_up, b_up, w_down_t, b_down, idx, activation, check_idx=True)``
- ``int8_linear(x, w_int8, scale)``: the int8 predictor's GEMV (the C kernel on CPU, see ``int8.py``)

The backend's CPU decode step calls more, registered from C++ when ``cpu_ops_available()`` builds
and loads them (fp32, bf16 and fp16 weights read as stored, sums in fp32, inference only, no Python
between Inductor's wrapper and the kernel; see ``cpu/cpu_ops.cpp``):
``cpu_sparse_mlp(x, w_a, w_b, w_down_t, idx, activation, b_a, b_b, b_down)`` (w_b None: plain MLP),
``cpu_glu_int8_topk(x, w_int8, scale, k, activation)`` (the int8 predictor's top k, ascending),
``cpu_glu_int8_mlp(x, w_int8, scale, w_down_t, k, activation, b_down)`` (the block from the int8
predictor's own values, plan entries with values "predictor"), ``cpu_linear(x, w, b)`` (a dense
projection's GEMV), ``cpu_linear_cat(x, ws, b)`` and ``cpu_q8_linear_cat(x, qs, scales, b)``
(projections of one input in one call, outputs concatenated),
``cpu_screened_linear(x, w, w_int8, scale, k, b)`` (an output head screened
by its int8 copy, the top k of each row exact), ``cpu_q8_linear(x, q, scales, b)`` (a projection
stored as int8 with per-group scales, ``compiler/quantize.py``'s format) and
``cpu_q8_sparse_mlp(x, q_a, s_a, q_b, s_b, q_down_t, s_down_t, idx, activation, b_a, b_b, b_down)``
(the sparse MLP over weights in that format: the kept neurons' gate and up rows, their rows of the
down weight stored transposed and quantized along its output) and
``cpu_q8_glu_mlp(x, q_a, s_a, q_b, s_b, q_down_t, s_down_t, k, activation, b_down)`` (a gated MLP of
that format chosen and valued by its own gate and up, the down weight's own int8 values and scales
read transposed).

Weight layouts are prepared once with ``prepare_gated_mlp_weights`` and ``prepare_mlp_weights``.
Triton launchers live in ``triton/`` (imported on first CUDA use, so this package imports without
triton; don't import it eagerly: under TRITON_INTERPRET the flag is read at its import). Activation
names and kernel codes come from ``dejavu_compile.activations``.

Notes for callers: inference only (no autograd formula). ``w_down_t``/``w_o_t`` should be
contiguous (F, d) (embedding_bag would copy a strided one on every call). Per-row indices (B, k) are
meant for decode batches (B <= 8); the CPU path loops over rows, so prefill should stay dense. The
idx range check syncs with the device: pass ``check_idx=False`` when the ids are valid by
construction (the backend does; required inside CUDA graphs), or set
``dejavu_compile.kernels._common.CHECK_INDICES = False`` to skip it everywhere.
"""
import importlib.util

import torch

from ._common import ACTIVATIONS
from .cpu import native as _native
from .int8 import int8_linear
from .mlp import sparse_gated_mlp, sparse_gated_mlp_torch, sparse_mlp, sparse_mlp_torch
from .prepare import prepare_gated_mlp_weights, prepare_mlp_weights, prepared_overhead


def cpu_ops_available() -> bool:
    """Whether the C++ CPU decode ops (``torch.ops.dejavu.cpu_*``) are built and loaded; builds them
    on the first call (once per machine), and warns once when that fails."""
    return _native.load_ops()


def triton_available() -> bool:
    """Whether the Triton kernels can run here: triton is installed and a CUDA device is visible.
    Does not import the kernels (their first import fixes TRITON_INTERPRET)."""
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None

__all__ = [
    "ACTIVATIONS", "int8_linear", "sparse_gated_mlp", "sparse_mlp", "sparse_gated_mlp_torch", "sparse_mlp_torch",
    "prepare_gated_mlp_weights", "prepare_mlp_weights",
    "prepared_overhead", "cpu_ops_available", "triton_available",
]
