"""Training-free selectors the predictors are compared against (not plan predictor kinds); their
scores follow the same "top-k wins" convention."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dejavu_compile.plan.predictors.metrics import topk_mask


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
