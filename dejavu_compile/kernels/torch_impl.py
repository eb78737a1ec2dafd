"""The sparse ops in torch: the CPU path wherever the C kernel does not apply (dtypes other than
fp32, no C compiler, ``DEJAVU_CPU_NATIVE=0``), for the MLP ops.
Arguments are checked by the caller (``mlp.py``).

Gate/up gather-GEMV of a large call (``FUSED_MIN_ELEMENTS``): one loop that Inductor generates from
``w[rows] * x`` summed over d (``torch.compile``, dynamic shapes, compiled once per process and
variant). It reads each selected row in place, vectorized, gate and up rows in one pass, on all
threads. Short rows wait on DRAM at each row start, which is why the C kernel exists.

Small calls, and machines where Inductor cannot compile: the selected rows are gathered in L2-sized
chunks with ``index_select(out=)`` into one reused buffer and multiplied there (no compile). If gate
and up are the two halves of one (F, 2, d) tensor (``prepare_gated_mlp_weights``), one gather
fetches both.

Down projection: ``embedding_bag(mode="sum", per_sample_weights=h)``, a weighted sum of rows read in
place; idx is split into several bags so the rows are summed in parallel.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _common as C

# Bytes of weight rows gathered per chunk and thread: small enough that the chunk stays in L2 for
# the matmul, large enough that each index_select/mm call does real work.
CHUNK_BYTES = 1 << 20

# Gather-GEMVs reading at least this many weight elements (k * d * 2 for gate+up) take the
# Inductor-fused loop; below it the compiled call's fixed overhead outweighs what the loop saves.
# DEJAVU_CPU_FUSED=0 turns the fused loop off.
FUSED_MIN_ELEMENTS = 1 << 19
_FUSED = {"fn": None, "enabled": os.environ.get("DEJAVU_CPU_FUSED", "1") != "0"}


def stacked_rows(w_a: Tensor, w_b: Tensor) -> Optional[Tensor]:
    """(F, 2d) view when w_a/w_b are the [:, 0] and [:, 1] halves of one (F, 2, d) tensor."""
    n, d = w_a.shape
    if (w_a.stride() == (2 * d, 1) and w_b.stride() == (2 * d, 1)
            and w_a.untyped_storage().data_ptr() == w_b.untyped_storage().data_ptr()
            and w_b.storage_offset() == w_a.storage_offset() + d):
        return w_a.as_strided((n, 2 * d), (2 * d, 1))
    return None


def gather_gemv(mats: list[Tensor], rows: Tensor, xt: Tensor, out: Tensor) -> None:
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


def gather_activate(x: Tensor, w_a: Tensor, w_b: Optional[Tensor], rows: Tensor, b_a: Optional[Tensor],
                    b_b: Optional[Tensor], activation: str) -> Tensor:
    """h[b, i] = act(w_a[rows[b, i]].x_b + b_a) * (w_b[rows[b, i]].x_b + b_b), in fp32, as plain ops:
    compiled, ``w[rows] * x`` summed over d becomes one loop that reads the rows in place. (Gate and
    up stay two reductions: Inductor vectorizes one (k, 2, d) reduction over stacked rows worse.)"""
    xf = x.float()[:, None, :]
    a = (w_a[rows].float() * xf).sum(-1)
    u = (w_b[rows].float() * xf).sum(-1) if w_b is not None else None
    return activate_rows(a, u, rows, b_a, b_b, activation)


def activate_rows(a: Tensor, u: Optional[Tensor], rows: Tensor, b_a: Optional[Tensor], b_b: Optional[Tensor],
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


def fused_gather_activate(x, w_a, w_b, rows, b_a, b_b, activation) -> Optional[Tensor]:
    """``gather_activate`` compiled by Inductor, or None where it does not apply (small or non-CPU
    calls, the fused loop turned off, or Inductor failed here before: then it warns once)."""
    work = rows.shape[1] * x.shape[1] * (2 if w_b is not None else 1)
    if not _FUSED["enabled"] or x.device.type != "cpu" or work < FUSED_MIN_ELEMENTS:
        return None
    if torch._dynamo.config.disable:  # TORCH_COMPILE_DISABLE=1: run uncompiled it would copy W[rows]
        return None
    if _FUSED["fn"] is None:
        _FUSED["fn"] = torch.compile(gather_activate, dynamic=True, fullgraph=True)
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


def down_rows_sum(rows: Tensor, h: Tensor, w_down_t: Tensor, out: Tensor) -> None:
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


def chunked_gather_activate(x, w_a, w_b, idx, rows, b_a, b_b, activation) -> Tensor:
    """``gather_activate`` without a compiler: chunked gather + GEMV, then the activation."""
    nb = x.shape[0]
    gated = w_b is not None
    m = 2 if gated else 1
    k = rows.shape[1]
    stacked = stacked_rows(w_a, w_b) if gated else None
    mats = [stacked] if stacked is not None else ([w_a, w_b] if gated else [w_a])
    if idx.dim() == 1:  # one gather serves every row
        pre = C.empty(k, m, nb, dtype=x.dtype, device=x.device)
        gather_gemv(mats, idx, x.t(), pre)
        pre = pre.permute(2, 0, 1)  # (B, k, m)
    else:
        pre = C.empty(nb, k, m, 1, dtype=x.dtype, device=x.device)
        for b in range(nb):
            gather_gemv(mats, rows[b], x[b, :, None], pre[b])
        pre = pre[..., 0]
    return activate_rows(pre[..., 0], pre[..., 1] if gated else None, rows, b_a, b_b, activation)


@torch.no_grad()
def sparse_mlp(x, w_a, w_b, w_down_t, idx, activation, b_a, b_b, b_down, out=None) -> Tensor:
    """Both MLP ops in torch (w_b None: the plain MLP); writes every element of `out`.
    Inference only, like the ops (no autograd formula): weights may be grad-enabled parameters."""
    nb = x.shape[0]
    rows = C.rows_2d(idx, nb)
    # Per-row idx (or batch 1): the fused loop. A shared idx over a batch takes the chunked path,
    # which reads each selected row once for all rows.
    h = fused_gather_activate(x, w_a, w_b, rows, b_a, b_b, activation) if idx.dim() == 2 or nb == 1 else None
    if h is None:
        h = chunked_gather_activate(x, w_a, w_b, idx, rows, b_a, b_b, activation)
    h = h.to(x.dtype)
    if out is None:
        out = C.empty(nb, w_down_t.shape[1], dtype=x.dtype, device=x.device)
    down_rows_sum(rows, h, w_down_t, out)
    if b_down is not None:
        out.add_(b_down)
    return out
