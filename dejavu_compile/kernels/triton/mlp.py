"""Triton kernels for the sparse ops (CUDA; CPU tensors under ``TRITON_INTERPRET=1``).

Two kernels serve the MLP ops and the head-sparse attention projections:

- ``_gather_gemv``: program (b, block of k) loads the selected row ids, then loops over d reading
  those rows of one or two (F, d) weights in place and dotting them with x_b in fp32; adds biases,
  applies the activation (``_act``: one branch per entry of the activation table, codes read from
  it) and the gate product, and stores h (B, k) in fp32.
- ``_gather_rows_sum``: the down projection as split-K: program (b, block of d_out, split s) sums
  h[b, i] * w_down_t[idx[b, i]] over its share of the k selected rows in fp32 and stores a partial
  (S, B, d_out); a torch sum reduces the S partials (deterministic, no atomics).

Weights are loaded in their dtype (fp16/bf16/fp32) and cast to fp32 for the math; results are cast
back on store (bf16 math is also wrong in the interpreter). Block sizes: autotuned per (k, d) on
CUDA; fixed, large configs elsewhere (autotune and do_bench need a GPU) or with
``DEJAVU_TRITON_AUTOTUNE=0``.

Interpret mode: triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` runs, i.e. when this module
is imported. Tests must set it before the first import of this module in the process.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl
import triton.runtime.interpreter  # not imported by `import triton` in every version (3.6: no)
from torch import Tensor

from dejavu_compile import activations

from .. import _common as C

# The activation codes, from the table (globals a jit function may read must be tl.constexpr).
_SILU = tl.constexpr(activations.ACTIVATIONS["silu"].code)
_GELU = tl.constexpr(activations.ACTIVATIONS["gelu"].code)
_GELU_TANH = tl.constexpr(activations.ACTIVATIONS["gelu_tanh"].code)
_RELU = tl.constexpr(activations.ACTIVATIONS["relu"].code)
_RELU2 = tl.constexpr(activations.ACTIVATIONS["relu2"].code)
_IDENTITY = tl.constexpr(-1)  # no activation: the attention q projection; not a table code


@triton.jit
def _act(a, ACT: tl.constexpr):
    if ACT == _SILU:
        a = a * tl.sigmoid(a)
    elif ACT == _GELU:
        a = 0.5 * a * (1.0 + tl.math.erf(a * 0.7071067811865476))
    elif ACT == _GELU_TANH:
        z = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        a = 0.5 * a * (1.0 + (2.0 * tl.sigmoid(2.0 * z) - 1.0))  # tanh(z) via sigmoid
    elif ACT == _RELU:
        a = tl.maximum(a, 0.0)
    elif ACT == _RELU2:
        r = tl.maximum(a, 0.0)
        a = r * r
    else:
        tl.static_assert(ACT == _IDENTITY, "activation code without a case in _act")
    return a


@triton.jit
def _gather_gemv(x_ptr, wa_ptr, wb_ptr, ba_ptr, bb_ptr, idx_ptr, h_ptr,
                 K, D, stride_xb, stride_wa, stride_wb, stride_ib, stride_hb,
                 ACT: tl.constexpr, GATED: tl.constexpr, HAS_BA: tl.constexpr,
                 HAS_BB: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mk = offs_k < K
    rows = tl.load(idx_ptr + b * stride_ib + offs_k, mask=mk, other=0).to(tl.int64)
    acc_a = tl.zeros((BLOCK_K,), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        md = offs_d < D
        xv = tl.load(x_ptr + b * stride_xb + offs_d, mask=md, other=0.0).to(tl.float32)
        m2 = mk[:, None] & md[None, :]
        wa = tl.load(wa_ptr + rows[:, None] * stride_wa + offs_d[None, :], mask=m2, other=0.0)
        acc_a += tl.sum(wa.to(tl.float32) * xv[None, :], axis=1)
        if GATED:
            wb = tl.load(wb_ptr + rows[:, None] * stride_wb + offs_d[None, :], mask=m2, other=0.0)
            acc_b += tl.sum(wb.to(tl.float32) * xv[None, :], axis=1)
    if HAS_BA:
        acc_a += tl.load(ba_ptr + rows, mask=mk, other=0.0).to(tl.float32)
    h = _act(acc_a, ACT)
    if GATED:
        if HAS_BB:
            acc_b += tl.load(bb_ptr + rows, mask=mk, other=0.0).to(tl.float32)
        h = h * acc_b
    tl.store(h_ptr + b * stride_hb + offs_k, h, mask=mk)


@triton.jit
def _gather_rows_sum(h_ptr, idx_ptr, w_ptr, part_ptr, K, N, stride_hb, stride_ib, stride_w,
                     stride_ps, stride_pb, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < N
    s = tl.program_id(2)
    per = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K  # this split's rows: [s*per, (s+1)*per)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(s * per, (s + 1) * per, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < K
        rows = tl.load(idx_ptr + b * stride_ib + offs_k, mask=mk, other=0).to(tl.int64)
        hv = tl.load(h_ptr + b * stride_hb + offs_k, mask=mk, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * stride_w + offs_n[None, :],
                    mask=mk[:, None] & mn[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * hv[:, None], axis=0)
    tl.store(part_ptr + s * stride_ps + b * stride_pb + offs_n, acc, mask=mn)


# ---------------------------------------------------------------------------------------------
# launch configs

_AUTOTUNED: dict = {}


def _autotuned(name: str):
    """The kernel wrapped in triton.autotune (CUDA only; built on first use)."""
    if name not in _AUTOTUNED:
        if name == "gemv":
            configs = [triton.Config({"BLOCK_K": bk, "BLOCK_D": bd}, num_warps=w)
                       for bk, bd, w in ((8, 256, 4), (16, 256, 4), (16, 512, 8), (32, 128, 4),
                                         (32, 256, 8), (64, 128, 8), (4, 1024, 4))]
            _AUTOTUNED[name] = triton.autotune(configs, key=["K", "D", "GATED"])(_gather_gemv)
        else:
            configs = [triton.Config({"BLOCK_K": bk, "BLOCK_N": bn}, num_warps=w)
                       for bk, bn, w in ((16, 256, 4), (32, 256, 8), (16, 512, 8), (64, 128, 4),
                                         (32, 128, 4), (8, 1024, 8))]
            _AUTOTUNED[name] = triton.autotune(configs, key=["K", "N", "SPLIT"])(_gather_rows_sum)
    return _AUTOTUNED[name]


def _autotune_on(x: Tensor) -> bool:
    """Autotune on CUDA unless DEJAVU_TRITON_AUTOTUNE=0 (tests: one fixed config per shape)."""
    return x.is_cuda and os.environ.get("DEJAVU_TRITON_AUTOTUNE", "1") != "0"


def _split_for(nb: int, k: int, n: int, device: torch.device) -> int:
    """Split-K factor: enough programs to fill the GPU (~4 per SM) with >= 64 rows per split."""
    if device.type != "cuda":
        return max(1, min(4, k // 64))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = nb * triton.cdiv(n, 256)
    return max(1, min(triton.cdiv(4 * sms, tiles), triton.cdiv(k, 64)))


def interpreted() -> bool:
    """Whether the kernels were decorated under TRITON_INTERPRET=1 (they then run on CPU tensors)."""
    return isinstance(_gather_gemv, triton.runtime.interpreter.InterpretedFunction)


def _check_runnable(x: Tensor) -> None:
    if x.device.type != "cuda" and not interpreted():
        raise RuntimeError("triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before "
                           "dejavu_compile.kernels.triton.mlp is first imported "
                           f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r})")


# ---------------------------------------------------------------------------------------------
# launchers


def gather_gemv(x: Tensor, w_a: Tensor, w_b: Optional[Tensor], b_a: Optional[Tensor],
                b_b: Optional[Tensor], rows: Tensor, activation: Optional[str],
                out: Optional[Tensor] = None) -> Tensor:
    """h[b, i] = act(w_a[rows[b, i]].x_b + b_a) (* (w_b[rows[b, i]].x_b + b_b)), fp32 (B, k);
    activation None: no activation.

    rows: (B, k) int64 (an expanded (k,) is fine: stride 0 is honoured). Weights need unit stride
    along d; their row stride is free (stacked gate/up views work)."""
    _check_runnable(x)
    nb, d = x.shape
    k = rows.shape[1]
    if out is None:
        out = C.empty(nb, k, dtype=torch.float32, device=x.device)
    gated = w_b is not None
    args = (x, w_a, w_b if gated else w_a, b_a if b_a is not None else w_a,
            b_b if b_b is not None else w_a, rows, out, k, d, x.stride(0), w_a.stride(0),
            (w_b if gated else w_a).stride(0), rows.stride(0), out.stride(0))
    code = _IDENTITY if activation is None else activations.ACTIVATIONS[activation].code
    flags = dict(ACT=code, GATED=gated, HAS_BA=b_a is not None, HAS_BB=b_b is not None)
    if _autotune_on(x):
        _autotuned("gemv")[lambda meta: (nb, triton.cdiv(k, meta["BLOCK_K"]))](*args, **flags)
    else:
        bk = min(64, triton.next_power_of_2(k))
        _gather_gemv[(nb, triton.cdiv(k, bk))](*args, **flags, BLOCK_K=bk, BLOCK_D=128)
    return out


def gather_rows_sum(h: Tensor, rows: Tensor, w: Tensor, bias: Optional[Tensor], dtype: torch.dtype,
                    out: Optional[Tensor] = None) -> Tensor:
    """out[b] = sum_i h[b, i] * w[rows[b, i]] (+ bias), in fp32 split-K, cast to dtype. (B, N)."""
    _check_runnable(h)
    nb, k = h.shape
    n = w.shape[1]
    split = _split_for(nb, k, n, h.device)
    part = C.empty(split, nb, n, dtype=torch.float32, device=h.device)
    args = (h, rows, w, part, k, n, h.stride(0), rows.stride(0), w.stride(0), part.stride(0), part.stride(1))
    if _autotune_on(h):
        _autotuned("rows_sum")[lambda meta: (nb, triton.cdiv(n, meta["BLOCK_N"]), split)](*args, SPLIT=split)
    else:
        bn = min(256, triton.next_power_of_2(n))
        _gather_rows_sum[(nb, triton.cdiv(n, bn), split)](*args, SPLIT=split, BLOCK_K=32, BLOCK_N=bn)
    total = part.sum(0)
    if bias is not None:
        total += bias.float()
    if out is None:
        out = C.empty(nb, n, dtype=dtype, device=h.device)
    out.copy_(total)
    return out


def _check_unit_stride(name: str, w: Tensor) -> None:
    if w.stride(-1) != 1:
        raise ValueError(f"{name} needs unit stride along its last dim, got strides {w.stride()}")


def sparse_gated_mlp_triton(x, w_gate, w_up, w_down_t, idx, activation, b_gate=None, b_up=None,
                            b_down=None, *, out: Optional[Tensor] = None, check: bool = True) -> Tensor:
    """Triton ``sparse_gated_mlp`` (same arguments as the op; ``out`` for tests)."""
    if check:
        C.check_mlp(x, w_gate, w_up, w_down_t, idx, activation, b_gate, b_up, b_down, "w_gate", "w_up")
        C.check_idx_range("idx", idx, w_gate.shape[0])
    for name, w in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down_t", w_down_t)):
        _check_unit_stride(name, w)
    rows = C.rows_2d(idx, x.shape[0])
    h = gather_gemv(x, w_gate, w_up, b_gate, b_up, rows, activation)
    return gather_rows_sum(h, rows, w_down_t, b_down, x.dtype, out)


def sparse_mlp_triton(x, w_up, b_up, w_down_t, b_down, idx, activation, *,
                      out: Optional[Tensor] = None, check: bool = True) -> Tensor:
    """Triton ``sparse_mlp`` (same arguments as the op; ``out`` for tests)."""
    if check:
        C.check_mlp(x, w_up, None, w_down_t, idx, activation, b_up, None, b_down, "w_up", None)
        C.check_idx_range("idx", idx, w_up.shape[0])
    for name, w in (("x", x), ("w_up", w_up), ("w_down_t", w_down_t)):
        _check_unit_stride(name, w)
    rows = C.rows_2d(idx, x.shape[0])
    h = gather_gemv(x, w_up, None, b_up, None, rows, activation)
    return gather_rows_sum(h, rows, w_down_t, b_down, x.dtype, out)
