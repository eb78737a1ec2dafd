"""Head-sparse decode attention (CPU torch path) against a float64 dense masked reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.conftest_kernels import (assert_close, attention_cases, attention_problem, attention_reference,  # noqa: F401
                              attn_args, poison)
from dejavu_compile.kernels import prepare_attention_weights, sparse_head_attention, sparse_head_attention_torch

torch.set_num_threads(1)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=attention_cases(), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_sparse_head_attention_matches_masked_dense(case, dtype, poison):
    p = attention_problem(dtype=dtype, **case)
    ref, bound = attention_reference(p)
    out = torch.full((p["x"].shape[0], p["w_o_t"].shape[1]), float("nan"), dtype=dtype)
    sparse_head_attention_torch(*attn_args(p), out=out)
    assert_close(out, ref, bound, dtype, "torch path")
    assert_close(sparse_head_attention(*attn_args(p)), ref, bound, dtype, "custom op")


def test_reference_detects_a_wrong_kv_head():
    """The comparison can fail: GQA with every query head reading kv head 0 is caught."""
    p = attention_problem(0, 2, 16, 2, 2, 8, 6, 8, 4, torch.float32, False, False, "dynamic")
    ref, bound = attention_reference(p)
    args = attn_args(p)
    args[3] = p["k_cache"][:, :1].expand_as(p["k_cache"]).contiguous()
    args[4] = p["v_cache"][:, :1].expand_as(p["v_cache"]).contiguous()
    with pytest.raises(AssertionError):
        assert_close(sparse_head_attention(*args), ref, bound, torch.float32)


@pytest.mark.parametrize("hkv", [4, 2, 1])  # MHA, GQA, MQA
@pytest.mark.parametrize("static", [False, True])
def test_full_heads_equal_dense_llama_attention(hkv, static):
    """All heads selected == q_proj, HF apply_rotary_pos_emb, SDPA over the cache, o_proj."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    torch.manual_seed(0)
    nb, hidden, h, d, t = 2, 64, 4, 16, 7
    q_proj, o_proj = torch.nn.Linear(hidden, h * d, bias=False), torch.nn.Linear(h * d, hidden, bias=False)
    x = torch.randn(nb, hidden)
    tmax = t + 5 if static else t
    k_cache, v_cache = torch.randn(nb, hkv, tmax, d), torch.randn(nb, hkv, tmax, d)
    pos = torch.tensor([[t - 1]] * nb).float()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([pos * inv, pos * inv], -1)
    cos, sin = emb.cos(), emb.sin()
    with torch.no_grad():
        q = q_proj(x).view(nb, 1, h, d).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos[:, None], sin[:, None])
        mask = (torch.arange(tmax) < t).expand(nb, 1, 1, tmax)
        o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)
        dense = o_proj(o.transpose(1, 2).reshape(nb, h * d))
        prep = prepare_attention_weights(q_proj.weight, o_proj.weight)
        valid = torch.full((nb,), t) if static else None
        out = sparse_head_attention(x, prep["w_q"], None, k_cache[:, :, :tmax if static else t],
                                    v_cache[:, :, :tmax if static else t], prep["w_o_t"], None,
                                    torch.arange(h), cos, sin, valid, None, d ** -0.5, d)
    torch.testing.assert_close(out, dense, rtol=1e-4, atol=1e-5)


def _args():
    torch.manual_seed(1)
    return dict(x=torch.randn(2, 16), w_q=torch.randn(32, 16), b_q=None, k_cache=torch.randn(2, 2, 5, 8),
                v_cache=torch.randn(2, 2, 5, 8), w_o_t=torch.randn(32, 16), b_o=None,
                head_idx=torch.tensor([0, 3]), cos=torch.randn(2, 8), sin=torch.randn(2, 8),
                valid_len=None, attn_mask=None, scale=0.35, rotary_dim=8)


@pytest.mark.parametrize("change, exc, word", [
    (dict(head_idx=torch.tensor([0, 4])), ValueError, "head_idx"),
    (dict(head_idx=torch.tensor([0, 1], dtype=torch.int32)), TypeError, "head_idx"),
    (dict(w_q=torch.randn(30, 16)), ValueError, "w_q"),
    (dict(w_q=torch.randn(24, 16)), ValueError, "kv heads"),
    (dict(w_o_t=torch.randn(16, 32)), ValueError, "w_o_t"),
    (dict(v_cache=torch.randn(2, 2, 4, 8)), ValueError, "v_cache"),
    (dict(k_cache=torch.randn(3, 2, 5, 8), v_cache=torch.randn(3, 2, 5, 8)), ValueError, "k_cache"),
    (dict(k_cache=torch.randn(2, 2, 5, 8, dtype=torch.float16)), TypeError, "k_cache"),
    (dict(cos=torch.randn(2, 6)), ValueError, "cos"),
    (dict(rotary_dim=7), ValueError, "rotary_dim"),
    (dict(valid_len=torch.tensor([5, 6])), ValueError, "valid_len"),
    (dict(valid_len=torch.tensor([5, 5], dtype=torch.int32)), TypeError, "valid_len"),
    (dict(attn_mask=torch.ones(2, 4, dtype=torch.bool)), ValueError, "attn_mask"),
    (dict(b_o=torch.randn(3)), ValueError, "b_o"),
])
def test_bad_input_raises_clear_error(change, exc, word):
    args = {**_args(), **change}
    for fn in (sparse_head_attention, sparse_head_attention_torch):
        with pytest.raises(exc, match=word):
            fn(*args.values())


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_full_heads_equal_hf_llama_attention_decode(cache_kind, kv_heads):
    """All heads selected == transformers LlamaAttention decoding one token from a real HF cache
    (DynamicCache grown by cat, or StaticCache of Tmax slots with a mask)."""
    from transformers import DynamicCache, LlamaConfig, StaticCache
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16,
                      intermediate_size=128, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    att, rope = LlamaAttention(cfg, layer_idx=0).eval(), LlamaRotaryEmbedding(cfg)
    nb, t0, tmax = 2, 5, 9
    cache = DynamicCache(config=cfg) if cache_kind == "dynamic" else StaticCache(config=cfg, max_cache_len=tmax)
    prompt, step = torch.randn(nb, t0, 64), torch.randn(nb, 1, 64)

    def mask(q_pos):  # additive (B, 1, q, T): causal, and nothing beyond what was written
        t = t0 + 1 if cache_kind == "dynamic" and len(q_pos) == 1 else (t0 if cache_kind == "dynamic" else tmax)
        allowed = torch.arange(t)[None, :] <= q_pos[:, None]
        return torch.zeros(nb, 1, len(q_pos), t).masked_fill(~allowed, float("-inf"))

    with torch.no_grad():
        pos = torch.arange(t0)
        att(prompt, rope(prompt, pos[None].expand(nb, -1)), mask(pos), cache=cache, cache_position=pos)
        pos = torch.tensor([t0])
        cos, sin = rope(step, pos[None].expand(nb, -1))
        dense, _ = att(step, (cos, sin), mask(pos), cache=cache, cache_position=pos)
        keys, values = cache.layers[0].keys, cache.layers[0].values
        assert keys.shape[2] == (t0 + 1 if cache_kind == "dynamic" else tmax)
        prep = prepare_attention_weights(att.q_proj.weight, att.o_proj.weight)
        valid = torch.full((nb,), t0 + 1) if cache_kind == "static" else None
        out = sparse_head_attention(step[:, 0], prep["w_q"], None, keys, values, prep["w_o_t"], None,
                                    torch.arange(4), cos[:, 0], sin[:, 0], valid, None, att.scaling, 16)
    torch.testing.assert_close(out, dense[:, 0], rtol=1e-4, atol=1e-5)
