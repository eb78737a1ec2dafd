"""Deja Vu's low-rank neuron/head predictors and the training-free selectors they compete with.

A predictor maps a block input x (d) to one score per neuron (MLP) or query head (attention):
    scores = B^T act(A^T x + a) + b        A: (d, r), B: (r, F)
Deja Vu used no nonlinearity between the two layers ("none"); "relu" is the alternative we tried.
The block keeps the top-k scores. Training uses the collected (input, |activation|) pairs:
  * "bce": Deja Vu's loss, binary labels "neuron is in the true top-k of this token";
  * "soft": a listwise loss, cross-entropy between softmax(scores) and the token's normalised
    |activation| distribution, which ranks all neurons (so one predictor serves every k).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NONLINEARITIES = ("none", "relu")
LOSSES = ("bce", "soft", "mix")


class LowRankPredictor(torch.nn.Module):
    def __init__(self, d: int, rank: int, total: int, nonlinearity: str = "none", bias: bool = True):
        super().__init__()
        if nonlinearity not in NONLINEARITIES:
            raise ValueError(f"nonlinearity must be one of {NONLINEARITIES}, got {nonlinearity!r}")
        self.nonlinearity = nonlinearity
        self.A = torch.nn.Parameter(torch.randn(d, rank) / math.sqrt(d))
        self.B = torch.nn.Parameter(torch.randn(rank, total) / math.sqrt(rank))
        self.a = torch.nn.Parameter(torch.zeros(rank)) if bias else None
        self.b = torch.nn.Parameter(torch.zeros(total)) if bias else None

    @property
    def d(self) -> int:
        return self.A.shape[0]

    @property
    def rank(self) -> int:
        return self.A.shape[1]

    @property
    def total(self) -> int:
        return self.B.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self.A.dtype) @ self.A
        if self.a is not None:
            h = h + self.a
        if self.nonlinearity == "relu":
            h = torch.relu(h)
        s = h @ self.B
        if self.b is not None:
            s = s + self.b
        return s

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> int:
        return 2 * self.d * self.rank + 2 * self.rank * self.total

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"A": self.A.detach(), "B": self.B.detach()}
        if self.a is not None:
            out["a"] = self.a.detach()
            out["b"] = self.b.detach()
        return out

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], nonlinearity: str = "none") -> "LowRankPredictor":
        A, B = t["A"], t["B"]
        if A.dim() != 2 or B.dim() != 2 or A.shape[1] != B.shape[0]:
            raise ValueError(f"predictor shapes do not chain: A {tuple(A.shape)}, B {tuple(B.shape)}")
        p = cls(A.shape[0], A.shape[1], B.shape[1], nonlinearity, bias="a" in t)
        with torch.no_grad():
            p.A.copy_(A)
            p.B.copy_(B)
            if "a" in t:
                p.a.copy_(t["a"])
                p.b.copy_(t["b"])
        return p.eval().requires_grad_(False)


# --------------------------------------------------------------------------------------------------
# Metrics


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    idx = scores.topk(k, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)


def recall(scores: torch.Tensor, importance: torch.Tensor, k: int) -> float:
    """|pred top-k ∩ true top-k| / k, averaged over tokens."""
    if k >= importance.shape[-1]:
        return 1.0
    hit = topk_mask(scores, k) & topk_mask(importance, k)
    return hit.sum(-1).float().mean().item() / k


def mass_captured(scores: torch.Tensor, importance: torch.Tensor, k: int) -> float:
    """Share of the total |activation| mass that lands in the predicted top-k (oracle: scores=importance)."""
    kept = (importance * topk_mask(scores, k)).sum(-1)
    return (kept / importance.sum(-1).clamp_min(1e-12)).mean().item()


def mass_curve(scores: torch.Tensor, importance: torch.Tensor, ks) -> dict[int, float]:
    """mass_captured for many k at once (one sort instead of one top-k per k)."""
    order = scores.argsort(dim=-1, descending=True)
    cum = importance.gather(-1, order).cumsum(-1)
    total = cum[:, -1].clamp_min(1e-12)
    return {int(k): (cum[:, int(k) - 1] / total).mean().item() for k in ks}


# --------------------------------------------------------------------------------------------------
# Training


def _loss(scores, target_mask, target_dist, kind):
    if kind == "bce":
        return F.binary_cross_entropy_with_logits(scores, target_mask)
    if kind == "soft":
        return -(target_dist * F.log_softmax(scores, dim=-1)).sum(-1).mean()
    return F.binary_cross_entropy_with_logits(scores, target_mask) + (
        -(target_dist * F.log_softmax(scores, dim=-1)).sum(-1).mean()
    ) * 0.1


def train_predictor(
    x: torch.Tensor,
    importance: torch.Tensor,
    k: int,
    rank: int = 64,
    nonlinearity: str = "none",
    loss: str = "bce",
    steps: int = 300,
    lr: float = 3e-3,
    batch_size: int = 2048,
    weight_decay: float = 0.0,
    soft_power: float = 2.0,
    seed: int = 0,
) -> LowRankPredictor:
    """Fit a predictor whose top-k catches the true top-k of `importance` (N, F) from `x` (N, d).

    `soft_power` sharpens the soft target (importance**p, normalised): the loss then concentrates on
    the neurons that carry the mass, which is what the top-k has to keep.
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    torch.manual_seed(seed)
    n, d = x.shape
    total = importance.shape[1]
    k = max(1, min(k, total))
    rank = max(1, min(rank, d, total))
    x = x.float()
    imp = importance.float()
    # Standardise the input channels (LLM hidden states have a few huge channels); folded into A, a.
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    xs = (x - mu) / sd
    mask = topk_mask(imp, k).float()
    w = imp.pow(soft_power)
    dist = w / w.sum(-1, keepdim=True).clamp_min(1e-30)
    pred = LowRankPredictor(d, rank, total, nonlinearity)
    with torch.no_grad():  # start at the per-neuron base rate so early steps learn context only
        pred.b.copy_(torch.logit(mask.mean(0).clamp(1e-3, 1 - 1e-3)) if loss == "bce" else torch.log(dist.mean(0) + 1e-9))
    opt = torch.optim.Adam(pred.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    g = torch.Generator().manual_seed(seed)
    bs = min(batch_size, n)
    for _ in range(steps):
        idx = torch.randint(0, n, (bs,), generator=g)
        l = _loss(pred(xs[idx]), mask[idx], dist[idx], loss)
        opt.zero_grad(set_to_none=True)
        l.backward()
        opt.step()
        sched.step()
    with torch.no_grad():  # fold the standardisation: ((x - mu)/sd) A + a = x (A/sd) + (a - (mu/sd) A)
        A = pred.A / sd[:, None]
        pred.a.sub_((mu / sd) @ pred.A)
        pred.A.copy_(A)
    return pred.eval().requires_grad_(False)


# --------------------------------------------------------------------------------------------------
# Training-free selectors (scores with the same "top-k wins" convention)


def cats_scores(x: torch.Tensor, gate_weight: torch.Tensor, activation=F.silu) -> torch.Tensor:
    """CATS-style: |act(gate(x))| per neuron. Costs the full gate GEMV."""
    return activation(x.to(gate_weight.dtype) @ gate_weight.t()).abs()


def teal_input_mask(x: torch.Tensor, density: float) -> torch.Tensor:
    """TEAL-style: keep the largest-|x| `density` share of input channels (0/1 mask over d).

    TEAL sparsifies the *input* of each linear rather than choosing neurons: the MLP then runs
    gate/up on the masked input (reading only the kept weight columns). It is not a neuron selector;
    the harness applies it as an input mask at the same density.
    """
    d = x.shape[-1]
    k = max(1, int(round(density * d)))
    return topk_mask(x.abs(), k).to(x.dtype)


@dataclass
class Cost:
    predictor_params: int
    predictor_flops: int
    block_params: int
    block_flops: int

    @property
    def ratio(self) -> float:
        return self.predictor_flops / max(1, self.block_flops)


# --------------------------------------------------------------------------------------------------
# Gated-MLP predictor ("glu"), fitted in closed form


class _one_thread:
    """LAPACK eigh/solve with 2 OpenMP threads on a busy 2-core machine measured 100x slower
    (16 s vs 0.14 s for a 577x577 eigh): run the small factorisations single-threaded."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)


def _ridge_map(x_in: torch.Tensor, x_block: torch.Tensor, ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge least squares of `x_block` on [x_in, 1], in float64: (C, S) with C the (d+1)^2 ridged
    second moments of [x_in, 1] and S (d+1, d_block) the map, x_block ~= [x_in, 1] S."""
    n, d = x_in.shape
    xa = torch.cat([x_in.double(), torch.ones(n, 1, dtype=torch.float64)], 1)
    C = xa.T @ xa
    C += ridge * C.diagonal()[:d].mean() * torch.eye(d + 1, dtype=torch.float64)
    with _one_thread():
        return C, torch.linalg.solve(C, xa.T @ x_block.double())


@torch.no_grad()
def fit_glu_predictor(
    x_in: torch.Tensor,
    x_block: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    rank: int,
    ridge: float = 1e-3,
) -> dict[str, torch.Tensor]:
    """Low-rank copy of a gated MLP's gate and up projections, as seen from `x_in`.

    Deja Vu's low-rank predictor barely beats random on SwiGLU (measured: 0.58 top-50% recall on
    SmolLM2): |act(g.x) * (u.x)| is a product of two projections, which one low-rank map can't
    rank. So we predict g.x and u.x separately with rank-r maps and score |act(g~) * u~|.
    Each map is a reduced-rank regression of the block's pre-activations Y = x_block W^T on
    [x_in, 1] (x_in = x_block without lookahead, the previous block's input with it): ridge
    least squares, then projection on the top-r principal directions of the fitted Y. Everything
    runs on d x d / F x F covariances: no SGD, a fraction of a second per layer.

    Returns {"A": (d, 2r), "a": (2r,), "B": (2r, F)} with the gate half first.
    """
    n, d = x_in.shape
    rank = max(1, min(rank, d + 1, gate_weight.shape[0]))
    C, sol = _ridge_map(x_in, x_block, ridge)
    with _one_thread():
        L = torch.linalg.cholesky(C)
    As, as_, Bs = [], [], []
    for w in (gate_weight, up_weight):
        W = sol @ w.double().T  # (d+1, F)
        # Top-r principal directions of the fitted pre-activations Y^ = [x,1] W, whose covariance is
        # W^T C W = M^T M with M = L^T W (C = L L^T): eigen-decompose the small (d+1)^2 matrix M M^T
        # instead of the F x F covariance (d << F).
        M = L.T @ W
        with _one_thread():
            evals, U = torch.linalg.eigh(M @ M.T)
        U, evals = U[:, -rank:].flip(1), evals[-rank:].flip(0)
        V = (M.T @ U) / evals.clamp_min(1e-30).sqrt()  # (F, r) orthonormal
        P = W @ V
        As.append(P[:d])
        as_.append(P[d])
        Bs.append(V.T)
    return {"A": torch.cat(As, 1).float(), "a": torch.cat(as_).float(), "B": torch.cat(Bs, 0).float()}


def glu_scores(x: torch.Tensor, t: dict[str, torch.Tensor], activation=F.silu) -> torch.Tensor:
    h = x.float() @ t["A"] + t["a"]
    r = t["B"].shape[0] // 2
    return (activation(h[:, :r] @ t["B"][:r]) * (h[:, r:] @ t["B"][r:])).abs()


def int8_glu_predictor(gate_weight: torch.Tensor, up_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gated MLP's own gate and up rows in int8 (symmetric, one scale per row) as its predictor.

    A low-rank map can't rank |act(g.x) * (u.x)| on SwiGLU (see `fit_glu_predictor`); an int8 copy
    computes it with ~1% error (`dejavu::int8_linear`, FBGEMM on CPU), which is enough to pick
    nearly the oracle's top-k (measured on SmolLM2: held-out perplexity within 0.8 pp of the oracle
    at 50% and 60% density), at a sixth of the bytes of an fp32 block. Returns {"A": (2F, d) int8, "a": (2F,) fp32 scales}, gate rows first.
    """
    w = torch.cat([gate_weight, up_weight]).detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return {"A": q, "a": scale}


def int8_glu_scores(x: torch.Tensor, t: dict[str, torch.Tensor], activation=F.silu) -> torch.Tensor:
    """(N, d) -> (N, F) |act(g~) * u~| through the op the compiled graph runs."""
    from dejavu_compile.kernels.int8 import int8_linear

    h = int8_linear(x.float(), t["A"], t["a"])
    n = t["A"].shape[0] // 2
    return (activation(h[:, :n]) * h[:, n:]).abs()


# --------------------------------------------------------------------------------------------------
# Learned 4-bit gated-MLP predictor ("glu_int4"), fitted on the calibration activations

INT4_GROUP = 32  # input columns that share one scale


@torch.no_grad()
def fit_int4_glu_predictor(
    x_in: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    x_block: torch.Tensor | None = None,
    group: int = INT4_GROUP,
    damp: float = 0.01,
    ridge: float = 1e-3,
) -> dict[str, torch.Tensor]:
    """A 4-bit copy of the gate and up projections, as seen from `x_in`, fitted to the calibration
    activations.

    The low-rank maps of `fit_glu_predictor` need about the block's own bytes to rank SwiGLU
    neurons well (benchmarks/predictor_rank.py); keeping every input direction at 4 bits costs an
    eighth. Rounding each weight to its nearest 4-bit value ignores which input directions the
    text uses; here the rows are fitted to the collected inputs X instead: each weight column is
    rounded in turn and its rounding error, weighted by the inputs' second moments H = X^T X / N,
    is pushed onto the columns not yet rounded (GPTQ's error feedback, Frantar et al. 2022), which
    minimises the error of the pre-activations (W - Q) x on this text rather than of the weights.
    Symmetric 4-bit codes in [-7, 7], one fp16 scale per row and `group` input columns.

    With lookahead (`x_block` given: the block's own inputs, `x_in` another block's), the rows first become the least-squares map
    from [x_in, 1] to the block's pre-activations: W' = W S^T, bias b = W s (S, s fitted by ridge
    regression of `x_block` on `x_in`), and W' is fitted as above.

    Returns {"A": (2F, d/2) uint8 packed codes, "a": (2F, d/group) fp16 scales} (gate rows first),
    plus "b": (2F,) fp32 biases with lookahead.
    """
    n, d = x_in.shape
    if d % group or d % 2:
        raise ValueError(f"the int4 predictor needs the block width ({d}) to be a multiple of its group ({group})")
    x = x_in.double()
    weights = torch.cat([gate_weight, up_weight]).detach().double()
    bias = None
    if x_block is not None:
        _, sol = _ridge_map(x_in, x_block, ridge)  # [x_in, 1] -> x_block
        bias = (weights @ sol[d]).float()
        weights = weights @ sol[:d].T
    H = x.T @ x / n
    H += damp * H.diagonal().mean() * torch.eye(d, dtype=torch.float64)
    with _one_thread():
        U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    codes = torch.empty(weights.shape, dtype=torch.int8)
    scales = torch.empty(weights.shape[0], d // group, dtype=torch.float16)
    W = weights.clone()
    for col in range(d):
        if col % group == 0:  # the group's scale from its columns as they stand after earlier feedback
            s = (W[:, col:col + group].abs().amax(1) / 7).clamp_min(1e-8).half()
            scales[:, col // group] = s
            scale = s.double()
        q = (W[:, col] / scale).round().clamp(-7, 7)
        codes[:, col] = q.to(torch.int8)
        err = (W[:, col] - q * scale) / U[col, col]
        W[:, col + 1:] -= err[:, None] * U[col, col + 1:][None, :]
    out = {"A": pack_int4(codes), "a": scales}
    if bias is not None:
        out["b"] = bias
    return out


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(R, d) int8 codes in [-8, 7] -> (R, d/2) uint8: column 2j in the low nibble, 2j+1 in the high, + 8."""
    u = (codes.to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: (R, d/2) uint8 -> (R, d) int8 codes."""
    low, high = packed & 15, packed >> 4
    return (torch.stack([low, high], -1).reshape(packed.shape[0], -1).to(torch.int8) - 8)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(2F, d) fp32 rows of a "glu_int4" predictor from its packed codes (A) and group scales (a)
    (the backend's graph spells the same arithmetic out in aten ops: passes/sparsify.py)."""
    codes = unpack_int4(packed).float()
    rows, d = codes.shape
    scales = scales.float()
    return (codes.view(rows, scales.shape[1], -1) * scales[:, :, None]).view(rows, d)


def int4_glu_scores(x: torch.Tensor, t: dict[str, torch.Tensor], activation=F.silu) -> torch.Tensor:
    """(N, d) -> (N, F) |act(g~) * u~| of a "glu_int4" predictor."""
    h = x.float() @ dequantize_int4(t["A"], t["a"]).T
    if t.get("b") is not None:
        h = h + t["b"].float()
    n = h.shape[-1] // 2
    return (activation(h[..., :n]) * h[..., n:]).abs()
