"""How well scores pick neurons: recall of the true top-k and captured |activation| mass."""
from __future__ import annotations

import torch


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
