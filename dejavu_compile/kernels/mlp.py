"""Neuron-sparse MLP ops: ``dejavu::sparse_gated_mlp`` and ``dejavu::sparse_mlp``.

Both compute, for each row b of x, only the intermediate neurons listed in idx[b] (or in a shared
idx), reading only those rows of the weights:

    gated:  y_b = sum_{j in idx[b]} act(w_gate[j].x_b + b_gate[j]) * (w_up[j].x_b + b_up[j]) * w_down_t[j] + b_down
    plain:  y_b = sum_{j in idx[b]} act(w_up[j].x_b + b_up[j]) * w_down_t[j] + b_down

``w_down_t`` is the down projection's weight transposed, stored contiguous (F, d), so a neuron's
down column is one contiguous row (see ``prepare.py``).

CPU path, fp32: a C kernel (``cpu_sparse_mlp.c``, built on first use by ``native.py``, whose
docstring gives its measured efficiency) makes one pass over the selected neurons, reading each
one's gate, up and down rows back to back.

CPU path, other dtypes (or no C compiler, or ``DEJAVU_CPU_NATIVE=0``): torch. The gate/up
gather-GEMV of a large call (``FUSED_MIN_ELEMENTS``) is one loop that Inductor generates from
``w[rows] * x`` summed over d (``torch.compile``, dynamic shapes, compiled once per process and
variant): it reads each selected row in place, vectorized, gate and up rows in one pass, on all
threads (0.74-0.83 of the bandwidth limit at 25-75% density on LLaMA-7B shapes; short rows such as
SmolLM2's 2.3 KB wait on DRAM at each row start and reach far less). Small calls, and machines where
Inductor cannot compile, gather the selected rows in L2-sized chunks with ``index_select(out=)``
into one reused buffer and multiply them there (about half the dense bandwidth, no compile). If gate
and up are the two halves of one (F, 2, d) tensor (``prepare_gated_mlp_weights``), one gather
fetches both. The down projection is ``embedding_bag(mode="sum", per_sample_weights=h)``, a
weighted sum of rows read in place; idx is split into several bags so the rows are summed in
parallel. CUDA path: Triton (``triton_mlp.py``).
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _common as C
from . import native

# Gather this many bytes of weight rows per chunk and thread: the chunk stays in L2 for the matmul.
# (Measured on LLaMA-7B rows, 2 threads: 256 KiB/thread is 40% slower, 1-2 MiB/thread is best.)
CHUNK_BYTES = 1 << 20

# Gather-GEMVs reading at least this many weight elements (k * d * 2 for gate+up) take the
# Inductor-fused loop; below it a compiled call's overhead (~30 us) outweighs what it saves.
# DEJAVU_CPU_FUSED=0 turns the fused loop off.
FUSED_MIN_ELEMENTS = 1 << 19
_FUSED = {"fn": None, "enabled": os.environ.get("DEJAVU_CPU_FUSED", "1") != "0"}


# ---------------------------------------------------------------------------------------------
# checks (metadata only: shared by the fake and the real kernels)


def _check(x, w_a, w_b, w_down_t, idx, activation, b_a, b_b, b_down, a_name, b_name) -> None:
    C.check_x(x)
    C.check_activation(activation)
    C.check_tensor(a_name, w_a, 2, x)
    n_neurons, d = w_a.shape
    if d != x.shape[1]:
        raise ValueError(f"{a_name} has {d} input features but x has {x.shape[1]}")
    if w_b is not None:
        C.check_tensor(b_name, w_b, 2, x)
        C.check_shape(b_name, w_b, (n_neurons, d))
    C.check_tensor("w_down_t", w_down_t, 2, x)
    if w_down_t.shape[0] != n_neurons:
        raise ValueError(f"w_down_t must be (F={n_neurons}, d_out) (the down weight transposed), "
                         f"got shape {tuple(w_down_t.shape)}")
    for name, bias, size in (("b_gate" if w_b is not None else "b_up", b_a, n_neurons),
                             ("b_up", b_b, n_neurons), ("b_down", b_down, w_down_t.shape[1])):
        if bias is not None:
            C.check_tensor(name, bias, 1, x)
            C.check_shape(name, bias, (size,))
    C.check_idx("idx", idx, x.shape[0], x)
    if idx.shape[-1] > n_neurons:
        raise ValueError(f"idx selects {idx.shape[-1]} neurons but there are only {n_neurons}")


# ---------------------------------------------------------------------------------------------
# CPU (torch) path


def _stacked_rows(w_a: Tensor, w_b: Tensor) -> Optional[Tensor]:
    """(F, 2d) view when w_a/w_b are the [:, 0] and [:, 1] halves of one (F, 2, d) tensor."""
    n, d = w_a.shape
    if (w_a.stride() == (2 * d, 1) and w_b.stride() == (2 * d, 1)
            and w_a.untyped_storage().data_ptr() == w_b.untyped_storage().data_ptr()
            and w_b.storage_offset() == w_a.storage_offset() + d):
        return w_a.as_strided((n, 2 * d), (2 * d, 1))
    return None


def _gather_gemv(mats: list[Tensor], rows: Tensor, xt: Tensor, out: Tensor) -> None:
    """out[i, m, :] = mats[m][rows[i]] @ xt for every i, reading each weight row once.

    mats: one (F, m*d) tensor (stacked halves) or m separate (F, d); xt (d, B); out (k, m, B).
    Rows are gathered a chunk at a time into one small buffer that stays in cache for the matmul.
    """
    k, m, nb = out.shape
    d = xt.shape[0]
    chunk = min(k, max(8, CHUNK_BYTES * torch.get_num_threads() // (m * d * xt.element_size())))
    if len(mats) == 1:
        buf = C.empty(chunk, m * d, dtype=xt.dtype, device=xt.device)
        for s in range(0, k, chunk):
            n = min(k, s + chunk) - s
            torch.index_select(mats[0], 0, rows[s:s + n], out=buf[:n])
            torch.mm(buf[:n].view(n * m, d), xt, out=out[s:s + n].view(n * m, nb))
        return
    buf = C.empty(m, chunk, d, dtype=xt.dtype, device=xt.device)
    res = C.empty(m, chunk, nb, dtype=xt.dtype, device=xt.device)
    for s in range(0, k, chunk):
        n = min(k, s + chunk) - s
        for j, w in enumerate(mats):
            torch.index_select(w, 0, rows[s:s + n], out=buf[j, :n])
            torch.mm(buf[j, :n], xt, out=res[j, :n])
        out[s:s + n].copy_(res[:, :n].transpose(0, 1))


def _gather_activate(x: Tensor, w_a: Tensor, w_b: Optional[Tensor], rows: Tensor, b_a: Optional[Tensor],
                     b_b: Optional[Tensor], activation: str) -> Tensor:
    """h[b, i] = act(w_a[rows[b, i]].x_b + b_a) * (w_b[rows[b, i]].x_b + b_b), in fp32, as plain ops:
    compiled, ``w[rows] * x`` summed over d becomes one loop that reads the rows in place. (One loop
    over stacked gate|up rows measured slower: Inductor vectorizes the (k, 2, d) reduction worse.)"""
    xf = x.float()[:, None, :]
    a = (w_a[rows].float() * xf).sum(-1)
    u = (w_b[rows].float() * xf).sum(-1) if w_b is not None else None
    return _activate_rows(a, u, rows, b_a, b_b, activation)


def _activate_rows(a: Tensor, u: Optional[Tensor], rows: Tensor, b_a: Optional[Tensor], b_b: Optional[Tensor],
                   activation: str) -> Tensor:
    """act(a + b_a[rows]) (* (u + b_b[rows]) when gated), in fp32 (cheap: k values per row)."""
    a = a.float()
    if b_a is not None:
        a = a + b_a.float()[rows]
    h = C.activate(a, activation)
    if u is not None:
        u = u.float()
        if b_b is not None:
            u = u + b_b.float()[rows]
        h = h * u
    return h


def _fused_gather_activate(x, w_a, w_b, rows, b_a, b_b, activation) -> Optional[Tensor]:
    """``_gather_activate`` compiled by Inductor, or None where it does not apply (small or non-CPU
    calls, the fused loop turned off, or Inductor failed here before: then it warns once)."""
    work = rows.shape[1] * x.shape[1] * (2 if w_b is not None else 1)
    if not _FUSED["enabled"] or x.device.type != "cpu" or work < FUSED_MIN_ELEMENTS:
        return None
    if torch._dynamo.config.disable:  # TORCH_COMPILE_DISABLE=1: run uncompiled it would copy W[rows]
        return None
    if _FUSED["fn"] is None:
        _FUSED["fn"] = torch.compile(_gather_activate, dynamic=True, fullgraph=True)
    try:
        # inference_mode: the same guards whether called through the op (autograd keys excluded)
        # or directly. One graph per variant (dtype, biases, gated, batch 1 or more, stacked
        # weights): allow more than Dynamo's default 8 before it gives up.
        with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=64):
            return _FUSED["fn"](x, w_a, w_b, rows, b_a, b_b, activation)
    except Exception as err:  # no C++ compiler, an unsupported platform: keep working, unfused
        _FUSED["enabled"] = False
        warnings.warn(f"dejavu: the Inductor-fused CPU gather failed ({type(err).__name__}: {err}); "
                      "using the chunked torch path from now on", RuntimeWarning, stacklevel=3)
        return None


def _down_rows_sum(rows: Tensor, h: Tensor, w_down_t: Tensor, out: Tensor) -> None:
    """out[b] = sum_i h[b, i] * w_down_t[rows[b, i]]; rows, h (B, k); rows read in place.

    Each row's list is cut into `splits` bags so embedding_bag sums them on all threads.
    """
    nb, k = rows.shape
    splits = max(1, min(2 * torch.get_num_threads(), k // 64))
    per = -(-k // splits)
    splits = -(-k // per)
    offsets = torch.arange(0, k, per, device=rows.device)
    if nb > 1:
        offsets = (torch.arange(0, nb * k, k, device=rows.device)[:, None] + offsets).reshape(-1)
    bags = F.embedding_bag(rows.reshape(-1), w_down_t, offsets, mode="sum",
                           per_sample_weights=h.reshape(-1))
    torch.sum(bags.view(nb, splits, -1), dim=1, out=out)


def _chunked_gather_activate(x, w_a, w_b, idx, rows, b_a, b_b, activation) -> Tensor:
    """``_gather_activate`` without a compiler: chunked gather + GEMV, then the activation."""
    nb = x.shape[0]
    gated = w_b is not None
    m = 2 if gated else 1
    k = rows.shape[1]
    stacked = _stacked_rows(w_a, w_b) if gated else None
    mats = [stacked] if stacked is not None else ([w_a, w_b] if gated else [w_a])
    if idx.dim() == 1:  # one gather serves every row
        pre = C.empty(k, m, nb, dtype=x.dtype, device=x.device)
        _gather_gemv(mats, idx, x.t(), pre)
        pre = pre.permute(2, 0, 1)  # (B, k, m)
    else:
        pre = C.empty(nb, k, m, 1, dtype=x.dtype, device=x.device)
        for b in range(nb):
            _gather_gemv(mats, rows[b], x[b, :, None], pre[b])
        pre = pre[..., 0]
    return _activate_rows(pre[..., 0], pre[..., 1] if gated else None, rows, b_a, b_b, activation)


@torch.no_grad()
def _mlp_torch(x, w_a, w_b, w_down_t, idx, activation, b_a, b_b, b_down, out=None) -> Tensor:
    """Shared CPU body; w_b is None for the plain MLP. Writes every element of `out`.
    Inference only, like the ops (no autograd formula): weights may be grad-enabled parameters."""
    nb = x.shape[0]
    if native.applies(x, [w_a, w_b, w_down_t, b_a, b_b, b_down], idx):
        if out is not None and not out.is_contiguous():
            return out.copy_(native.sparse_mlp_f32(x, w_a, w_b, w_down_t, idx, activation, b_a, b_b, b_down))
        return native.sparse_mlp_f32(x, w_a, w_b, w_down_t, idx, activation, b_a, b_b, b_down, out)
    rows = C.rows_2d(idx, nb)
    # Per-row idx (or batch 1): the fused loop. A shared idx over a batch takes the chunked path,
    # which reads each selected row once for all rows.
    h = _fused_gather_activate(x, w_a, w_b, rows, b_a, b_b, activation) if idx.dim() == 2 or nb == 1 else None
    if h is None:
        h = _chunked_gather_activate(x, w_a, w_b, idx, rows, b_a, b_b, activation)
    h = h.to(x.dtype)
    if out is None:
        out = C.empty(nb, w_down_t.shape[1], dtype=x.dtype, device=x.device)
    _down_rows_sum(rows, h, w_down_t, out)
    if b_down is not None:
        out.add_(b_down)
    return out


def sparse_gated_mlp_torch(x, w_gate, w_up, w_down_t, idx, activation, b_gate=None, b_up=None,
                           b_down=None, *, out: Optional[Tensor] = None, check_idx: bool = True) -> Tensor:
    """CPU/torch implementation of ``sparse_gated_mlp`` (checks included; ``out`` for tests)."""
    _check(x, w_gate, w_up, w_down_t, idx, activation, b_gate, b_up, b_down, "w_gate", "w_up")
    if check_idx:
        C.check_idx_range("idx", idx, w_gate.shape[0])
    return _mlp_torch(x, w_gate, w_up, w_down_t, idx, activation, b_gate, b_up, b_down, out)


def sparse_mlp_torch(x, w_up, b_up, w_down_t, b_down, idx, activation, *,
                     out: Optional[Tensor] = None, check_idx: bool = True) -> Tensor:
    """CPU/torch implementation of ``sparse_mlp`` (checks included; ``out`` for tests)."""
    _check(x, w_up, None, w_down_t, idx, activation, b_up, None, b_down, "w_up", None)
    if check_idx:
        C.check_idx_range("idx", idx, w_up.shape[0])
    return _mlp_torch(x, w_up, None, w_down_t, idx, activation, b_up, None, b_down, out)


# ---------------------------------------------------------------------------------------------
# custom ops


@torch.library.custom_op("dejavu::sparse_gated_mlp", mutates_args=())
def sparse_gated_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down_t: Tensor, idx: Tensor,
                     activation: str, b_gate: Optional[Tensor] = None, b_up: Optional[Tensor] = None,
                     b_down: Optional[Tensor] = None, check_idx: bool = True) -> Tensor:
    """y = sum over j in idx of act(w_gate[j].x + b_gate[j]) * (w_up[j].x + b_up[j]) * w_down_t[j] + b_down.

    x (B, d); w_gate, w_up (F, d); w_down_t (F, d_out); idx int64 (k,) shared or (B, k) per row;
    activation in {"silu", "gelu", "gelu_tanh", "relu"}; biases optional. Returns (B, d_out).
    check_idx=False skips the idx range check, which reads idx (a device sync on CUDA, impossible
    inside a CUDA-graph capture); the backend passes False because its idx come from topk.
    """
    return sparse_gated_mlp_torch(x, w_gate, w_up, w_down_t, idx, activation, b_gate, b_up, b_down,
                                  check_idx=check_idx)


@sparse_gated_mlp.register_kernel("cuda")
def _(x, w_gate, w_up, w_down_t, idx, activation, b_gate=None, b_up=None, b_down=None, check_idx=True):
    _check(x, w_gate, w_up, w_down_t, idx, activation, b_gate, b_up, b_down, "w_gate", "w_up")
    if check_idx:
        C.check_idx_range("idx", idx, w_gate.shape[0])
    from . import triton_mlp
    return triton_mlp.sparse_gated_mlp_triton(x, w_gate, w_up, w_down_t, idx, activation,
                                              b_gate, b_up, b_down, check=False)


@sparse_gated_mlp.register_fake
def _(x, w_gate, w_up, w_down_t, idx, activation, b_gate=None, b_up=None, b_down=None, check_idx=True):
    _check(x, w_gate, w_up, w_down_t, idx, activation, b_gate, b_up, b_down, "w_gate", "w_up")
    return x.new_empty(x.shape[0], w_down_t.shape[1])


@torch.library.custom_op("dejavu::sparse_mlp", mutates_args=())
def sparse_mlp(x: Tensor, w_up: Tensor, b_up: Optional[Tensor], w_down_t: Tensor,
               b_down: Optional[Tensor], idx: Tensor, activation: str, check_idx: bool = True) -> Tensor:
    """y = sum over j in idx of act(w_up[j].x + b_up[j]) * w_down_t[j] + b_down (OPT, GPT-2).

    x (B, d); w_up (F, d); w_down_t (F, d_out); b_up (F,) / b_down (d_out,) or None;
    idx int64 (k,) or (B, k); check_idx as in ``sparse_gated_mlp``. Returns (B, d_out).
    """
    return sparse_mlp_torch(x, w_up, b_up, w_down_t, b_down, idx, activation, check_idx=check_idx)


@sparse_mlp.register_kernel("cuda")
def _(x, w_up, b_up, w_down_t, b_down, idx, activation, check_idx=True):
    _check(x, w_up, None, w_down_t, idx, activation, b_up, None, b_down, "w_up", None)
    if check_idx:
        C.check_idx_range("idx", idx, w_up.shape[0])
    from . import triton_mlp
    return triton_mlp.sparse_mlp_triton(x, w_up, b_up, w_down_t, b_down, idx, activation, check=False)


@sparse_mlp.register_fake
def _(x, w_up, b_up, w_down_t, b_down, idx, activation, check_idx=True):
    _check(x, w_up, None, w_down_t, idx, activation, b_up, None, b_down, "w_up", None)
    return x.new_empty(x.shape[0], w_down_t.shape[1])
