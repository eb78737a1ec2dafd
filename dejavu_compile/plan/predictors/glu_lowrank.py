"""Low-rank gated predictor ("glu_lowrank"): a rank-r copy of a gated MLP's gate and up projections,
fitted in closed form.

    h = x in_proj + in_bias          in_proj: (d, 2r), gate half first
    scores = |act(h[:r] out_proj[:r]) * (h[r:] out_proj[r:])|     out_proj: (2r, F)

|act(g.x) * (u.x)| is a product of two projections, which one low-rank map (Deja Vu's two-layer
predictor) ranks poorly; predicting g.x and u.x separately and scoring their product does better.
"""
from __future__ import annotations

import torch

from dejavu_compile import activations
from dejavu_compile.plan.predictors.linalg import one_thread, ridge_map
from dejavu_compile.plan.predictors.registry import FitInputs, PredictorKind, register


def glu_lowrank_scores(x: torch.Tensor, in_proj: torch.Tensor, in_bias: torch.Tensor, out_proj: torch.Tensor,
                       activation: str = "silu") -> torch.Tensor:
    """(B, d) -> (B, F) scores; the graph node the compiler inserts."""
    h = torch.matmul(x, in_proj) + in_bias
    r = out_proj.shape[0] // 2
    gate = activations.torch_fn(activation)(torch.matmul(h[..., :r], out_proj[:r]))
    return (gate * torch.matmul(h[..., r:], out_proj[r:])).abs()


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

    Each map is a reduced-rank regression of the block's pre-activations Y = x_block W^T on
    [x_in, 1] (x_in = x_block without lookahead, the previous block's input with it): ridge
    least squares, then projection on the top-r principal directions of the fitted Y. Everything
    runs on d x d / F x F covariances: no SGD.

    Returns {"in_proj": (d, 2r), "in_bias": (2r,), "out_proj": (2r, F)} with the gate half first.
    """
    n, d = x_in.shape
    rank = max(1, min(rank, d + 1, gate_weight.shape[0]))
    C, sol = ridge_map(x_in, x_block, ridge)
    with one_thread():
        L = torch.linalg.cholesky(C)
    As, as_, Bs = [], [], []
    for w in (gate_weight, up_weight):
        W = sol @ w.double().T  # (d+1, F)
        # Top-r principal directions of the fitted pre-activations Y^ = [x,1] W, whose covariance is
        # W^T C W = M^T M with M = L^T W (C = L L^T): eigen-decompose the small (d+1)^2 matrix M M^T
        # instead of the F x F covariance (d << F).
        M = L.T @ W
        with one_thread():
            evals, U = torch.linalg.eigh(M @ M.T)
        U, evals = U[:, -rank:].flip(1), evals[-rank:].flip(0)
        V = (M.T @ U) / evals.clamp_min(1e-30).sqrt()  # (F, r) orthonormal
        P = W @ V
        As.append(P[:d])
        as_.append(P[d])
        Bs.append(V.T)
    return {"in_proj": torch.cat(As, 1).float(), "in_bias": torch.cat(as_).float(),
            "out_proj": torch.cat(Bs, 0).float()}


def glu_scores(x: torch.Tensor, t: dict[str, torch.Tensor], activation: str = "silu") -> torch.Tensor:
    """(N, d) -> (N, F) scores of fitted tensors `t`, in fp32."""
    return GLU_LOWRANK.scores(t, x.float(), activation)


class GluLowRank(PredictorKind):
    name = "glu_lowrank"
    v1_names = {"A": "in_proj", "a": "in_bias", "B": "out_proj"}
    needs_gate = True
    v1_code = "glu"
    option, default_density, default_lookahead = "lowrank", 0.98, True
    graph_scores = staticmethod(glu_lowrank_scores)

    def fit(self, data: FitInputs) -> dict[str, torch.Tensor]:
        return fit_glu_predictor(data.x, data.x_block, data.gate, data.up, data.rank)

    def validate(self, tensors, total):
        A, a, B = tensors.get("in_proj"), tensors.get("in_bias"), tensors.get("out_proj")
        ok = (A is not None and a is not None and B is not None and A.dim() == 2 and B.dim() == 2
              and A.shape[1] == B.shape[0] and A.shape[1] % 2 == 0 and B.shape[1] == total
              and tuple(a.shape) == (A.shape[1],))
        if not ok:
            shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in sorted(tensors.items()))
            raise ValueError(f"predictor shapes {shapes} do not fit total={total} (in_proj (d, 2r), "
                             f"in_bias (2r,), out_proj (2r, {total}))")

    def input_width(self, tensors):
        return tensors["in_proj"].shape[0]

    def flops(self, tensors):
        return 2 * (tensors["in_proj"].numel() + tensors["out_proj"].numel())

    def graph_inputs(self, tensors, activation, dtype):
        return {n: t.to(dtype) for n, t in tensors.items()}, {"activation": activation}


GLU_LOWRANK = register(GluLowRank())
