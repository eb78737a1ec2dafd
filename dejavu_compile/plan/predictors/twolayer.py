"""Deja Vu's trained two-layer predictor ("twolayer"; "twolayer_relu" with a ReLU between the layers).

    scores = act(x in_proj + in_bias) out_proj + out_bias      in_proj: (d, r), out_proj: (r, F)

Deja Vu used no nonlinearity between the layers; the ReLU variant is the alternative. It serves
plain MLPs (no gate to copy) and attention heads. Training uses the collected (input, |activation|)
pairs:
  * "bce": Deja Vu's loss, binary labels "neuron is in the true top-k of this token";
  * "soft": a listwise loss, cross-entropy between softmax(scores) and the token's normalised
    |activation| distribution, which ranks all neurons (so one predictor serves every k);
  * "mix": both, the listwise term weighted 0.1.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dejavu_compile.plan.predictors.metrics import topk_mask
from dejavu_compile.plan.predictors.registry import FitInputs, PredictorKind, register

LOSSES = ("bce", "soft", "mix")


def twolayer_scores(x: torch.Tensor, in_proj: torch.Tensor, out_proj: torch.Tensor, in_bias: torch.Tensor | None = None,
                    out_bias: torch.Tensor | None = None, relu: bool = False) -> torch.Tensor:
    """(B, d) -> (B, F) scores; the graph node the compiler inserts."""
    h = torch.matmul(x, in_proj)
    if in_bias is not None:
        h = h + in_bias
    if relu:
        h = torch.relu(h)
    s = torch.matmul(h, out_proj)
    if out_bias is not None:
        s = s + out_bias
    return s


class TwoLayer(PredictorKind):
    v1_names = {"A": "in_proj", "a": "in_bias", "B": "out_proj", "b": "out_bias"}
    graph_scores = staticmethod(twolayer_scores)

    def __init__(self, relu: bool):
        self.relu = relu
        self.name = "twolayer_relu" if relu else "twolayer"
        self.v1_code = "relu" if relu else "none"
        if not relu:  # the plain-MLP half of the "lowrank" alias, and the head predictor
            self.option, self.default_density, self.default_lookahead, self.for_heads = "lowrank", 0.98, True, True

    def fit(self, data: FitInputs) -> dict[str, torch.Tensor]:
        return train_predictor(data.x, data.importance, data.k, rank=data.rank, relu=self.relu, loss="bce",
                               steps=data.steps, seed=data.seed).tensors()

    def fit_heads(self, x, importance, seed):
        """A listwise loss (one predictor serves every k of heads)."""
        return train_predictor(x, importance, max(1, importance.shape[1] // 2), rank=min(64, x.shape[1]),
                               relu=self.relu, loss="soft", steps=150, batch_size=2048, seed=seed).tensors()

    def validate(self, tensors, total):
        A, B = tensors.get("in_proj"), tensors.get("out_proj")
        a, b = tensors.get("in_bias"), tensors.get("out_bias")
        ok = (A is not None and B is not None and A.dim() == 2 and B.dim() == 2 and A.shape[1] == B.shape[0]
              and B.shape[1] == total and (a is None or tuple(a.shape) == (A.shape[1],))
              and (b is None or tuple(b.shape) == (total,)))
        if not ok:
            raise ValueError(f"predictor shapes {_shapes(tensors)} do not fit total={total} "
                             f"(in_proj (d, r), out_proj (r, {total}), optional in_bias (r,), out_bias ({total},))")

    def input_width(self, tensors):
        return tensors["in_proj"].shape[0]

    def flops(self, tensors):
        return 2 * (tensors["in_proj"].numel() + tensors["out_proj"].numel())

    def graph_inputs(self, tensors, activation, dtype):
        return {n: t.to(dtype) for n, t in tensors.items()}, {"relu": self.relu}


def _shapes(tensors) -> str:
    return ", ".join(f"{n} {tuple(t.shape)}" for n, t in sorted(tensors.items())) or "none"


class LowRankPredictor(torch.nn.Module):
    """The trainable form of the two-layer predictor."""

    def __init__(self, d: int, rank: int, total: int, relu: bool = False, bias: bool = True):
        super().__init__()
        self.relu = relu
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
        return twolayer_scores(x.to(self.A.dtype), self.A, self.B, self.a, self.b, self.relu)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> int:
        return 2 * self.d * self.rank + 2 * self.rank * self.total

    def tensors(self) -> dict[str, torch.Tensor]:
        """The plan entry's tensors (see `TwoLayer`)."""
        out = {"in_proj": self.A.detach(), "out_proj": self.B.detach()}
        if self.a is not None:
            out["in_bias"] = self.a.detach()
            out["out_bias"] = self.b.detach()
        return out


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
    relu: bool = False,
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
    # the initialisation draws from the CPU generator seeded with `seed`; the caller's state is restored
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return _train(x, importance, k, rank, relu, loss, steps, lr, batch_size, weight_decay, soft_power, seed)


def _train(x, importance, k, rank, relu, loss, steps, lr, batch_size, weight_decay, soft_power,
           seed) -> LowRankPredictor:
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
    pred = LowRankPredictor(d, rank, total, relu)
    with torch.no_grad():  # start at the per-neuron base rate so early steps learn context only
        base = torch.logit(mask.mean(0).clamp(1e-3, 1 - 1e-3)) if loss == "bce" else torch.log(dist.mean(0) + 1e-9)
        pred.b.copy_(base)
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


TWOLAYER = register(TwoLayer(relu=False))
TWOLAYER_RELU = register(TwoLayer(relu=True))
