"""Shared helpers for the kernel tests: float64 dense masked references, random problems, tolerances.

Not a pytest conftest (tests import it as tests.conftest_kernels): the sparse ops are compared against the *dense*
computation on all neurons/heads with the unselected ones masked to zero, in float64.
"""
from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "inductor"))

import pytest
import torch
from hypothesis import strategies as st

from dejavu_compile import activations
from dejavu_compile.kernels import _common

# Relative tolerance per dtype, applied to a bound on the magnitude of the summed terms.
RTOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}
# Half a unit in the last place of each dtype, relative: the one rounding of a kernel's fp32 result
# into a half-precision output.
HALF_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


@pytest.fixture
def poison(monkeypatch):
    """Every internal buffer starts as NaN: a kernel that leaves part of one unwritten fails."""
    monkeypatch.setattr(_common, "POISON_BUFFERS", True)


def act64(t, activation):
    """The activation table's float64 reference (written apart from the torch function the ops use)."""
    return activations.get(activation).reference(t)


def act_bound(a, activation):
    """A bound on |act(t)| for |t| <= a - 1 that also bounds how far act moves when t moves by a
    small multiple of a: a itself for the activations of slope <= 1.13 (silu, gelu, relu), act(a)
    where act grows faster (squared ReLU: a^2 bounds both t^2 and 2|t| dt)."""
    return torch.maximum(a, act64(a, activation).abs())


def act_slope(a, activation):
    """A bound on |act'(t)| for |t| <= a: 1.13 (the largest slope of silu, gelu and gelu_tanh), or
    the secant over [a, a + 1] where act grows faster (convex, like squared ReLU)."""
    return torch.clamp_min(act64(a + 1, activation) - act64(a, activation), 1.13)


def int8_rows(gate, up):
    """The int8 predictor's weights: gate then up rows, int8 per row with fp32 scales (max |w| -> 127),
    as the plan's glu_int8 predictor quantizes them. Returns (rows (2F, d) int8, scales (2F,))."""
    w = torch.cat([gate, up]).detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous(), scale.contiguous()


def row_mask(idx, batch, size):
    """(batch, size) float64 mask, 1 on the selected ids of each row."""
    m = torch.zeros(batch, size, dtype=torch.float64)
    rows = idx.expand(batch, -1) if idx.dim() == 1 else idx
    m.scatter_(1, rows.cpu(), 1.0)
    return m


def random_idx(gen, batch, size, k, per_row):
    """Duplicate-free random ids: (k,) or (batch, k)."""
    if per_row:
        return torch.stack([torch.randperm(size, generator=gen)[:k] for _ in range(batch)])
    return torch.randperm(size, generator=gen)[:k]


def mlp_problem(seed, batch, d, n, k, dtype, gated, per_row, biases, d_out=None):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=gen, dtype=torch.float64))
    d_out = d if d_out is None else d_out
    p = {"x": r(batch, d), "w_up": r(n, d) / d ** 0.5, "w_down_t": r(n, d_out) / n ** 0.5,
         "b_up": r(n) if biases else None, "b_down": r(d_out) if biases else None}
    if gated:
        p["w_gate"] = r(n, d) / d ** 0.5
        p["b_gate"] = r(n) if biases else None
    p = {key: (v.to(dtype) if v is not None else None) for key, v in p.items()}
    p["idx"] = random_idx(gen, batch, n, k, per_row)
    return p


def mlp_reference(p, activation, gated):
    """(value, magnitude bound) in float64 from the dense block with unselected neurons masked."""
    f = lambda t: None if t is None else t.double()
    x, wu, wd = f(p["x"]), f(p["w_up"]), f(p["w_down_t"])
    m = row_mask(p["idx"], x.shape[0], wu.shape[0])
    u = x @ wu.T + (f(p["b_up"]) if p["b_up"] is not None else 0)
    u_abs = x.abs() @ wu.abs().T + (f(p["b_up"]).abs() if p["b_up"] is not None else 0)
    if gated:
        wg = f(p["w_gate"])
        g = x @ wg.T + (f(p["b_gate"]) if p["b_gate"] is not None else 0)
        g_abs = x.abs() @ wg.abs().T + (f(p["b_gate"]).abs() if p["b_gate"] is not None else 0)
        h, h_abs = act64(g, activation) * u, act_bound(g_abs + 1, activation) * u_abs
    else:
        h, h_abs = act64(u, activation), act_bound(u_abs + 1, activation)
    bd = f(p["b_down"]) if p["b_down"] is not None else 0
    return (h * m) @ wd + bd, (h_abs * m) @ wd.abs() + (bd.abs() if p["b_down"] is not None else 0) + 1


def assert_close(out, ref, bound, dtype, what=""):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), f"{what}: non-finite output (unwritten buffer?)"
    err = (out.double().cpu() - ref).abs()
    tol = RTOL[dtype] * bound
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"{what}: error {err.max().item():.3g} exceeds tolerance (ratio {worst:.3g})"


# --- attention ------------------------------------------------------------------------------------

def rotate_half(t):
    h = t.shape[-1] // 2
    return torch.cat([-t[..., h:], t[..., :h]], dim=-1)


def attention_problem(seed, batch, hidden, hkv, group, d, t, rotary_dim, k, dtype, per_row,
                      biases, cache):
    """cache: "dynamic" (all T valid), "static" (valid_len < T), "bool_mask", "float_mask"."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    h = hkv * group
    p = {"x": r(batch, hidden), "w_q": r(h * d, hidden) / hidden ** 0.5,
         "b_q": r(h * d) if biases else None, "k_cache": r(batch, hkv, t, d), "v_cache": r(batch, hkv, t, d),
         "w_o_t": r(h * d, hidden) / (h * d) ** 0.5, "b_o": r(hidden) if biases else None}
    if rotary_dim:
        pos = torch.randint(0, 100, (batch, 1), generator=gen).double()
        inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        freqs = torch.cat([pos * inv, pos * inv], dim=-1)
        p["cos"], p["sin"] = freqs.cos(), freqs.sin()
    else:
        p["cos"] = p["sin"] = None
    p = {key: (v.to(dtype) if v is not None else None) for key, v in p.items()}
    p["valid_len"] = p["attn_mask"] = None
    if cache == "static":
        p["valid_len"] = torch.randint(1, t + 1, (batch,), generator=gen)
    elif cache in ("bool_mask", "float_mask"):
        keep = torch.rand(batch, t, generator=gen) < 0.6
        keep[:, -1] = True  # the current token is always visible
        p["attn_mask"] = keep if cache == "bool_mask" else torch.zeros(batch, t, dtype=dtype).masked_fill(~keep, float("-inf"))
    p["head_idx"] = random_idx(gen, batch, h, k, per_row)
    p["scale"] = float(d) ** -0.5
    p["rotary_dim"] = rotary_dim
    return p


ATTN_ARGS = ("x", "w_q", "b_q", "k_cache", "v_cache", "w_o_t", "b_o", "head_idx", "cos", "sin",
             "valid_len", "attn_mask", "scale", "rotary_dim")


def attn_args(p):
    return [p[name] for name in ATTN_ARGS]


def attention_reference(p):
    """Dense attention over all heads in float64, unselected heads masked before the output proj."""
    f = lambda t: None if t is None else t.double()
    x, kc, vc = f(p["x"]), f(p["k_cache"]), f(p["v_cache"])
    nb, hkv, t, d = kc.shape
    h = p["w_q"].shape[0] // d
    q = x @ f(p["w_q"]).T + (f(p["b_q"]) if p["b_q"] is not None else 0)
    q = q.view(nb, h, d)
    rd = p["rotary_dim"]
    if rd:
        cos, sin = f(p["cos"])[:, None], f(p["sin"])[:, None]
        q = torch.cat([q[..., :rd] * cos + rotate_half(q[..., :rd]) * sin, q[..., rd:]], dim=-1)
    keys = kc.repeat_interleave(h // hkv, dim=1)
    vals = vc.repeat_interleave(h // hkv, dim=1)
    s = torch.einsum("bhd,bhtd->bht", q, keys) * p["scale"]
    if p["valid_len"] is not None:
        s = s.masked_fill((torch.arange(t)[None] >= p["valid_len"][:, None])[:, None], float("-inf"))
    if p["attn_mask"] is not None:
        am = p["attn_mask"]
        s = s.masked_fill(~am[:, None], float("-inf")) if am.dtype == torch.bool else s + f(am)[:, None]
    o = torch.einsum("bht,bhtd->bhd", torch.softmax(s, -1), vals)
    m = row_mask(p["head_idx"], nb, h)[..., None]
    wo = f(p["w_o_t"])
    bo = f(p["b_o"]) if p["b_o"] is not None else 0
    out = (o * m).reshape(nb, h * d) @ wo + bo
    q_abs = x.abs() @ f(p["w_q"]).abs().T + (f(p["b_q"]).abs() if p["b_q"] is not None else 0)
    bound = ((vals.abs().amax(2) * (1 + q_abs.view(nb, h, d).abs().sum(-1, keepdim=True) * keys.abs().amax((2, 3))[..., None])) * m
             ).reshape(nb, h * d) @ wo.abs() + (bo.abs() if p["b_o"] is not None else 0) + 1
    return out, bound


@st.composite
def attention_cases(draw, max_batch=8):
    hkv = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    d = draw(st.sampled_from([2, 4, 6, 8, 16]))
    rot = draw(st.sampled_from(["none", "partial", "full"]))
    rotary_dim = {"none": 0, "partial": max(2, (d // 2) // 2 * 2), "full": d}[rot]
    return dict(seed=draw(st.integers(0, 2**31)), batch=draw(st.integers(1, max_batch)),
                hidden=draw(st.integers(1, 40)), hkv=hkv, group=group, d=d, t=draw(st.integers(1, 12)),
                rotary_dim=rotary_dim, k=draw(st.integers(1, hkv * group)),
                per_row=draw(st.booleans()), biases=draw(st.booleans()),
                cache=draw(st.sampled_from(["dynamic", "static", "bool_mask", "float_mask"])))


@st.composite
def mlp_cases(draw, max_d=80, max_n=100, max_batch=8):
    n = draw(st.integers(1, max_n))
    k = draw(st.one_of(st.just(1), st.just(n), st.integers(1, n)))  # one element .. all
    return dict(seed=draw(st.integers(0, 2**31)), batch=draw(st.integers(1, max_batch)),
                d=draw(st.integers(1, max_d)), n=n, k=k, per_row=draw(st.booleans()),
                biases=draw(st.booleans()))
