"""Triton path of ``dejavu::sparse_head_attention``: the q and output projections run the gather
kernels of ``mlp.py`` around the torch attention of ``torch_impl.attend``."""
from __future__ import annotations

from torch import Tensor

from .. import _common as C
from .. import torch_impl
from . import mlp as T


def sparse_head_attention_triton(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos, sin,
                                 valid_len, attn_mask, scale, rotary_dim, *, out=None, check=True) -> Tensor:
    """Triton q/o projections (CUDA, or CPU under TRITON_INTERPRET=1) around torch attention."""
    h, hkv, d = C.check_attention(x, w_q, b_q, k_cache, v_cache, w_o_t, b_o, head_idx, cos, sin, valid_len,
                                  attn_mask, scale, rotary_dim)
    if check:
        C.check_attention_values(head_idx, valid_len, k_cache, h)
    nb = x.shape[0]
    rows = C.rows_2d(head_idx, nb)
    k = rows.shape[1]
    q_rows = torch_impl.head_rows(rows, d)
    q = T.gather_gemv(x, w_q, None, b_q, None, q_rows, None).view(nb, k, d)
    o = torch_impl.attend(q, k_cache, v_cache, rows // (h // hkv), cos, sin, valid_len, attn_mask, scale,
                          rotary_dim)
    return T.gather_rows_sum(o.reshape(nb, k * d), q_rows, w_o_t, b_o, x.dtype, out)
