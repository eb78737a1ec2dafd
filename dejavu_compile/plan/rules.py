"""The rules a plan is built by, shared by the training-free plan (``compiler/passes/auto_plan.py``)
and ``calibrate()``: the grid a layer's k lives on, the uniform allocation, whether a sparse layer
reads fewer bytes than its dense block, and a projection weight as rows."""
from __future__ import annotations

from typing import Optional

import torch


def k_multiple(total: int) -> int:
    """The step of a layer's k: multiples of 32 from 512 neurons, which the sparse kernels split into
    equal parts (bags, blocks); another k works too, padded."""
    return 32 if total >= 512 else 1


def k_grid(total: int, min_density: float = 0.125, steps: int = 16, multiple: int = 1) -> list[int]:
    """Candidate k values from total down to min_density*total (descending, unique, >= 1)."""
    ks = []
    for i in range(steps + 1):
        frac = 1.0 - i * (1.0 - min_density) / steps
        k = max(1, int(round(frac * total / multiple)) * multiple)
        k = min(k, total)
        if not ks or k < ks[-1]:
            ks.append(k)
    return ks


def uniform_k(total: int, target_density: float, multiple: int = 1) -> int:
    """The k nearest target_density * total on the grid of `multiple` (at least one step, at most total)."""
    if not 0.0 < target_density <= 1.0:
        raise ValueError(f"target density must be in (0, 1], got {target_density}")
    k = int(round(target_density * total / multiple)) * multiple
    return min(total, max(k, min(multiple, total)))


def predictor_share(kind, tensors: dict, gated: bool, hidden: int, total: int, element_size: int) -> float:
    """The bytes a predictor reads per step as a share of its dense MLP block's weight bytes."""
    dense_bytes = (3 if gated else 2) * hidden * total * element_size
    return kind.read_bytes(tensors, element_size) / dense_bytes


def sparse_pays(k: int, total: int, values: str, share: float) -> bool:
    """Whether k kept neurons plus the predictor (``share`` of the block's bytes) read less than the
    dense block. With values "predictor" a kept neuron reads only its down row (1/3 of a gated row)."""
    row_share = 1 / 3 if values == "predictor" else 1.0
    return k < total and row_share * k / total + share < 1.0


def weight_rows(weight: torch.Tensor, layout: str, rows: Optional[tuple[int, int]]) -> torch.Tensor:
    """A projection weight as (F, d) rows, whatever its layout (nn.Linear "out_in", Conv1D "in_out",
    a slice of a fused projection)."""
    w = weight.detach()
    if layout == "in_out":
        w = w.t()
    if rows is not None:
        w = w[rows[0]:rows[1]]
    return w
