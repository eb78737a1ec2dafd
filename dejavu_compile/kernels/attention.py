"""Head-sparse decode attention: ``dejavu::sparse_head_attention``.

    sparse_head_attention(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos, sin,
                          valid_len, attn_mask, scale, rotary_dim) -> (B, hidden_out)

One query token per sequence (decode). Only the selected query heads are projected, rotated, attend
and go through the output projection; the caller has already projected K/V for *all* KV heads and
written them to the cache, so the cache stays exact for later tokens.

- x (B, hidden); w_q (H*D, hidden) as in nn.Linear (head h owns rows h*D:(h+1)*D); b_q (H*D,) or None.
- k_cache, v_cache (B, Hkv, T, D), already holding this step's key/value. DynamicCache: T is the
  current length. StaticCache: T is Tmax; pass valid_len and/or attn_mask. H must be a multiple of
  Hkv (MHA: Hkv == H, GQA, MQA: Hkv == 1); query head h reads kv head h // (H // Hkv).
- w_o_t (H*D, hidden_out): the output projection's weight transposed, contiguous; b_o or None.
- head_idx int64 (k,) shared by all rows or (B, k) per row, distinct head ids in [0, H).
- cos, sin (B, rotary_dim) for this token's position, or None when rotary_dim == 0. LLaMA's
  rotate_half convention on the first rotary_dim dims of each head: q*cos + rotate_half(q)*sin
  (rotary_dim < D is partial rotary; keys in the cache are already rotated).
- valid_len (B,) int64 or None: keys at positions >= valid_len[b] are ignored.
- attn_mask (B, T) or None: bool (True = attend) or additive float (0 / -inf), e.g. left padding.
- scale: softmax scale (usually D ** -0.5).

Returns sum over selected heads h of softmax(q_h K^T * scale) V @ w_o_t[h*D:(h+1)*D] (+ b_o).
Scores, softmax and the weighted V sum run in fp32. Each row needs at least one attended key.

CPU path: the q projection gathers head blocks of w_q in cache-sized chunks (``mlp._gather_gemv``)
and the output projection is an embedding_bag over the selected rows of w_o_t (rows read in place).
CUDA path: the same two steps with the Triton gather kernels of ``triton_mlp.py``; the attention
itself (k heads x T keys) is plain torch on both.

The backend does not call this op: it lowers a plan's attention entries in the graph itself
(``compiler/passes/sparse_attention.py``), reusing each model's traced rotary and norm code, so that every
architecture the matcher knows gets the same computation without a per-model rotary convention.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _common as C
from .mlp import _down_rows_sum, _gather_gemv


def _check(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos, sin, valid_len, attn_mask,
           scale, rotary_dim) -> tuple[int, int, int]:
    """Metadata checks; returns (H, Hkv, D)."""
    C.check_x(x)
    C.check_tensor("k_cache", k_cache, 4, x)
    C.check_tensor("v_cache", v_cache, 4, x)
    C.check_shape("v_cache", v_cache, k_cache.shape)
    nb, hkv, t, d = k_cache.shape
    if nb != x.shape[0]:
        raise ValueError(f"k_cache has batch {nb} but x has batch {x.shape[0]}")
    C.check_tensor("w_q", w_q, 2, x)
    if w_q.shape[1] != x.shape[1] or w_q.shape[0] % d:
        raise ValueError(f"w_q must be (H*{d}, {x.shape[1]}), got shape {tuple(w_q.shape)}")
    h = w_q.shape[0] // d
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} kv heads (k_cache dim 1)")
    C.check_tensor("w_o_t", w_o_t, 2, x)
    if w_o_t.shape[0] != h * d:
        raise ValueError(f"w_o_t must be (H*D={h * d}, hidden_out), got shape {tuple(w_o_t.shape)}")
    if b_q is not None:
        C.check_tensor("b_q", b_q, 1, x)
        C.check_shape("b_q", b_q, (h * d,))
    if b_o is not None:
        C.check_tensor("b_o", b_o, 1, x)
        C.check_shape("b_o", b_o, (w_o_t.shape[1],))
    C.check_idx("head_idx", head_idx, nb, x)
    if head_idx.shape[-1] > h:
        raise ValueError(f"head_idx selects {head_idx.shape[-1]} heads but there are only {h}")
    if not 0 <= rotary_dim <= d or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and in [0, {d}], got {rotary_dim}")
    for name, t_ in (("cos", cos), ("sin", sin)):
        if rotary_dim == 0:
            if t_ is not None:
                raise ValueError(f"{name} must be None when rotary_dim == 0")
            continue
        C.check_tensor(name, t_, 2, x, float_=False)
        if not t_.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {t_.dtype}")
        C.check_shape(name, t_, (nb, rotary_dim))
    if valid_len is not None:
        C.check_tensor("valid_len", valid_len, 1, x, float_=False)
        if valid_len.dtype != torch.int64:
            raise TypeError(f"valid_len must be int64, got {valid_len.dtype}")
        C.check_shape("valid_len", valid_len, (nb,))
    if attn_mask is not None:
        C.check_tensor("attn_mask", attn_mask, 2, x, float_=False)
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask must be bool or floating, got {attn_mask.dtype}")
        C.check_shape("attn_mask", attn_mask, (nb, t))
    if not isinstance(scale, float) or scale <= 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    return h, hkv, d


def _check_values(head_idx, valid_len, k_cache, h) -> None:
    C.check_idx_range("head_idx", head_idx, h)
    if valid_len is not None and C.CHECK_INDICES:
        lo, hi = torch.aminmax(valid_len)
        if int(lo) < 1 or int(hi) > k_cache.shape[2]:
            raise ValueError(f"valid_len has values in [{int(lo)}, {int(hi)}], outside [1, {k_cache.shape[2]}]")


def _attend(q, k_cache, v_cache, kv_idx, cos, sin, valid_len, attn_mask, scale, rotary_dim) -> Tensor:
    """q (B, k, D) fp32 for the selected heads; kv_idx (B, k). Returns (B, k, D) fp32."""
    nb, _, t, d = k_cache.shape
    if rotary_dim:
        half = rotary_dim // 2
        qr = q[..., :rotary_dim]
        rot = torch.cat([-qr[..., half:], qr[..., :half]], dim=-1)
        q = torch.cat([qr * cos.float()[:, None] + rot * sin.float()[:, None], q[..., rotary_dim:]], -1)
    # Only the kv heads the selected heads use: one memcpy-style gather of (T, D) blocks.
    hkv = k_cache.shape[1]
    flat = (torch.arange(0, nb * hkv, hkv, device=q.device)[:, None] + kv_idx).reshape(-1)
    keys = k_cache.reshape(nb * hkv, t, d).index_select(0, flat).view(nb, -1, t, d).float()
    vals = v_cache.reshape(nb * hkv, t, d).index_select(0, flat).view(nb, -1, t, d).float()
    scores = torch.einsum("bkd,bktd->bkt", q, keys) * scale
    if valid_len is not None:
        beyond = torch.arange(t, device=q.device)[None, :] >= valid_len[:, None]
        scores = scores.masked_fill(beyond[:, None], float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask[:, None], float("-inf"))
        else:
            scores = scores + attn_mask.float()[:, None]
    return torch.einsum("bkt,bktd->bkd", torch.softmax(scores, dim=-1), vals)


def _head_rows(rows: Tensor, d: int) -> Tensor:
    """(B, k) head ids -> (B, k*D) row ids of those heads' D rows."""
    return (rows[..., None] * d + torch.arange(d, device=rows.device)).reshape(rows.shape[0], -1)


def sparse_head_attention_torch(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos, sin,
                                valid_len, attn_mask, scale, rotary_dim, *, out=None) -> Tensor:
    """CPU/torch implementation (checks included; ``out`` for tests)."""
    h, hkv, d = _check(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos, sin, valid_len,
                       attn_mask, scale, rotary_dim)
    _check_values(head_idx, valid_len, k_cache, h)
    nb, hidden = x.shape
    rows = C.rows_2d(head_idx, nb)
    k = rows.shape[1]
    # w_q as (H, D*hidden): gathering a head is gathering one row of it.
    w_heads = [w_q.reshape(h, d * hidden)]
    if head_idx.dim() == 1:
        q = C.empty(k, d, nb, dtype=x.dtype, device=x.device)
        _gather_gemv(w_heads, head_idx, x.t(), q)
        q = q.permute(2, 0, 1)
    else:
        q = C.empty(nb, k, d, 1, dtype=x.dtype, device=x.device)
        for b in range(nb):
            _gather_gemv(w_heads, rows[b], x[b, :, None], q[b])
        q = q[..., 0]
    q = q.float()
    if b_q is not None:
        q = q + b_q.float().view(h, d)[rows]
    o = _attend(q, k_cache, v_cache, rows // (h // hkv), cos, sin, valid_len, attn_mask, scale, rotary_dim)
    if out is None:
        out = C.empty(nb, w_o_t.shape[1], dtype=x.dtype, device=x.device)
    _down_rows_sum(_head_rows(rows, d), o.reshape(nb, k * d).to(x.dtype), w_o_t, out)
    if b_o is not None:
        out.add_(b_o)
    return out


def sparse_head_attention_triton(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos, sin,
                                 valid_len, attn_mask, scale, rotary_dim, *, out=None, check=True) -> Tensor:
    """Triton q/o projections (CUDA, or CPU under TRITON_INTERPRET=1) around torch attention."""
    from . import triton_mlp as T
    h, hkv, d = _check(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos, sin, valid_len,
                       attn_mask, scale, rotary_dim)
    if check:
        _check_values(head_idx, valid_len, k_cache, h)
    nb = x.shape[0]
    rows = C.rows_2d(head_idx, nb)
    k = rows.shape[1]
    q_rows = _head_rows(rows, d)
    q = T.gather_gemv(x, w_q, None, b_q, None, q_rows, "none").view(nb, k, d)
    o = _attend(q, k_cache, v_cache, rows // (h // hkv), cos, sin, valid_len, attn_mask, scale, rotary_dim)
    return T.gather_rows_sum(o.reshape(nb, k * d), q_rows, w_o_t, b_o, x.dtype, out)


@torch.library.custom_op("dejavu::sparse_head_attention", mutates_args=())
def sparse_head_attention(x: Tensor, w_q: Tensor, b_q: Optional[Tensor], k_cache: Tensor,
                          v_cache: Tensor, w_o_t: Tensor, b_o: Optional[Tensor], head_idx: Tensor,
                          cos: Optional[Tensor], sin: Optional[Tensor], valid_len: Optional[Tensor],
                          attn_mask: Optional[Tensor], scale: float, rotary_dim: int) -> Tensor:
    """Head-sparse decode attention; see the module docstring for the arguments."""
    return sparse_head_attention_torch(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos,
                                       sin, valid_len, attn_mask, scale, rotary_dim)


@sparse_head_attention.register_kernel("cuda")
def _(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos, sin, valid_len, attn_mask, scale, rotary_dim):
    return sparse_head_attention_triton(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos,
                                        sin, valid_len, attn_mask, scale, rotary_dim)


@sparse_head_attention.register_fake
def _(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos, sin, valid_len, attn_mask, scale, rotary_dim):
    _check(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos, sin, valid_len, attn_mask,
           scale, rotary_dim)
    return x.new_empty(x.shape[0], w_o_t.shape[1])
