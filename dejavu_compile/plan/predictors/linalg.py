"""Small float64 factorisations shared by the closed-form fits."""
from __future__ import annotations

import torch


class one_thread:
    """Run LAPACK single-threaded: on a busy machine with few cores, eigh/solve of these small
    matrices with several OpenMP threads is far slower than with one."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)


def ridge_map(x_in: torch.Tensor, x_block: torch.Tensor, ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge least squares of `x_block` on [x_in, 1], in float64: (C, S) with C the (d+1)^2 ridged
    second moments of [x_in, 1] and S (d+1, d_block) the map, x_block ~= [x_in, 1] S."""
    n, d = x_in.shape
    xa = torch.cat([x_in.double(), torch.ones(n, 1, dtype=torch.float64)], 1)
    C = xa.T @ xa
    C += ridge * C.diagonal()[:d].mean() * torch.eye(d + 1, dtype=torch.float64)
    with one_thread():
        return C, torch.linalg.solve(C, xa.T @ x_block.double())
