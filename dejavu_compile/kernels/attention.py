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

CPU path (``torch_impl.py``): the q projection gathers head blocks of w_q in cache-sized chunks and
the output projection sums the selected rows of w_o_t in place. CUDA path (``triton/attention.py``):
the same two steps with the Triton gather kernels; the attention itself (k heads x T keys) is plain
torch on both.

This is a standalone public op, tested on its own; the ``dejavu`` backend does not call it. The
backend lowers a plan's attention entries in the graph itself (``compiler/passes/sparse_attention.py``),
reusing each model's traced rotary and norm code, so every architecture the matcher knows gets the
same computation without a per-model rotary convention.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _common as C
from . import torch_impl


def sparse_head_attention_torch(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos, sin,
                                valid_len, attn_mask, scale, rotary_dim, *, out=None) -> Tensor:
    """The CPU implementation (checks included; ``out`` for tests)."""
    h, hkv, d = C.check_attention(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos, sin, valid_len,
                                  attn_mask, scale, rotary_dim)
    C.check_attention_values(head_idx, valid_len, k_cache, h)
    return torch_impl.sparse_head_attention(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos, sin,
                                            valid_len, attn_mask, scale, rotary_dim, h, hkv, d, out)


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
    from .triton.attention import sparse_head_attention_triton
    return sparse_head_attention_triton(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos,
                                        sin, valid_len, attn_mask, scale, rotary_dim)


@sparse_head_attention.register_fake
def _(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos, sin, valid_len, attn_mask, scale, rotary_dim):
    C.check_attention(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos, sin, valid_len, attn_mask,
                      scale, rotary_dim)
    return x.new_empty(x.shape[0], w_o_t.shape[1])
