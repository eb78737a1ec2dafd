"""Shared helpers for the kernel tests: float64 dense masked references, random problems, tolerances,
Hypothesis strategies, and the ops with sample arguments (opcheck, Inductor).

The sparse ops are compared against the *dense* computation on all neurons with the unselected ones
masked to zero, in float64. (The ``poison`` fixture, every internal buffer starting as NaN, lives in
tests/conftest.py.)
"""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from dejavu_compile import activations
from dejavu_compile.kernels import prepare_gated_mlp_weights, sparse_gated_mlp, sparse_mlp

# Relative tolerance per dtype, applied to a bound on the magnitude of the summed terms.
RTOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}
# Half a unit in the last place of each dtype, relative: the one rounding of a kernel's fp32 result
# into a half-precision output.
HALF_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def half_subnormal(dtype) -> float:
    """Half the fixed spacing of ``dtype``'s subnormals: a result below the normal range rounds by up to
    that whatever its relative error (an fp16 result under 3e-8 rounds to zero). 0 for fp32 results."""
    return 0.0 if dtype == torch.float32 else torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps / 2


def rounding_to(dtype, ref, bound):
    """The error of rounding a kernel's fp32 result (within ``bound`` of ``ref``) once into ``dtype``."""
    return HALF_ULP[dtype] * (ref.abs() + bound) + half_subnormal(dtype)


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

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

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
    def f(t):
        return None if t is None else t.double()

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
    tol = RTOL[dtype] * bound + half_subnormal(dtype)
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"{what}: error {err.max().item():.3g} exceeds tolerance (ratio {worst:.3g})"


@st.composite
def mlp_cases(draw, max_d=80, max_n=100, max_batch=8):
    n = draw(st.integers(1, max_n))
    k = draw(st.one_of(st.just(1), st.just(n), st.integers(1, n)))  # one element .. all
    return dict(seed=draw(st.integers(0, 2**31)), batch=draw(st.integers(1, max_batch)),
                d=draw(st.integers(1, max_d)), n=n, k=k, per_row=draw(st.booleans()),
                biases=draw(st.booleans()))


def _gated_samples():
    out = []
    for per_row, biases in ((False, False), (True, True)):
        p = mlp_problem(seed=1, batch=3, d=20, n=33, k=9, dtype=torch.float32, gated=True,
                        per_row=per_row, biases=biases)
        out.append(((p["x"], p["w_gate"], p["w_up"], p["w_down_t"], p["idx"], "silu"),
                    dict(b_gate=p["b_gate"], b_up=p["b_up"], b_down=p["b_down"])))
    # the prepared layout: gate/up are strided views of one (F, 2, d) tensor
    prep = prepare_gated_mlp_weights(p["w_gate"], p["w_up"], p["w_down_t"].t())
    out.append(((p["x"], prep["w_gate"], prep["w_up"], prep["w_down_t"], p["idx"], "gelu"), {}))
    return out


def _plain_samples():
    out = []
    for per_row, biases in ((False, True), (True, False)):
        p = mlp_problem(seed=2, batch=2, d=17, n=40, k=12, dtype=torch.float32, gated=False,
                        per_row=per_row, biases=biases)
        out.append(((p["x"], p["w_up"], p["b_up"], p["w_down_t"], p["b_down"], p["idx"], "relu"), {}))
    return out


# Each op and a function returning its sample calls, [(args, kwargs)]: opcheck and Inductor, on CPU and CUDA.
OPS = {"gated": (sparse_gated_mlp, _gated_samples), "plain": (sparse_mlp, _plain_samples)}
