"""Int8 gate/up predictor ("glu_int8"): the gated MLP's own gate and up rows in int8.

    rows: (2F, d) int8, gate rows then up rows, symmetric, one scale per row; scales: (2F,) fp32
    [g~, u~] = (x rows^T) * scales, scores = |act(g~) * u~|

Nothing is fitted: it is the block's own projections at 8 bits, so it reads the block's own input
(no lookahead) and picks nearly the oracle's neurons. It computes act(g~) * u~ for every neuron, so
the block can take its kept neurons' values from it (entry values "predictor") and read only their
down rows. On CPU fp32 the compiler runs it as the fused C++ ops (`int8_rows`).
"""
from __future__ import annotations

import torch

from dejavu_compile import activations
from dejavu_compile.kernels import int8_linear
from dejavu_compile.kernels.int8 import quantize_rows_int8
from dejavu_compile.plan.predictors.registry import FitInputs, PredictorKind, register


def glu_int8_values(x: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor,
                    activation: str = "silu") -> torch.Tensor:
    """(B, d) -> (B, F) signed act(g~) * u~, through ``dejavu::int8_linear``."""
    h = int8_linear(x, rows, scales)
    n = rows.shape[0] // 2
    return activations.torch_fn(activation)(h[..., :n]) * h[..., n:]


def glu_int8_scores(x: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor,
                    activation: str = "silu") -> torch.Tensor:
    """(B, d) -> (B, F) scores |act(g~) * u~|; the graph node the compiler inserts."""
    return torch.abs(glu_int8_values(x, rows, scales, activation))


def int8_glu_predictor(gate_weight: torch.Tensor, up_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"rows": (2F, d) int8, "scales": (2F,) fp32} of a gated MLP's gate and up weights (gate rows first)."""
    q, scale = quantize_rows_int8(torch.cat([gate_weight, up_weight]))
    return {"rows": q, "scales": scale}


class GluInt8(PredictorKind):
    name = "glu_int8"
    v1_names = {"A": "rows", "a": "scales"}
    quantized = needs_gate = needs_own_input = gives_values = int8_rows = training_free = True
    v1_code = "glu_int8"
    option, default_density, auto_devices = "int8", 0.6, ("cpu",)
    graph_scores = staticmethod(glu_int8_scores)
    graph_values = staticmethod(glu_int8_values)

    def fit(self, data: FitInputs) -> dict[str, torch.Tensor]:
        return int8_glu_predictor(data.gate, data.up)

    def from_weights(self, gate, up):
        return int8_glu_predictor(gate, up)

    def int8_operands(self, nodes):
        return nodes["rows"], nodes["scales"]

    def validate(self, tensors, total):
        rows, scales = tensors.get("rows"), tensors.get("scales")
        if (rows is None or rows.dtype != torch.int8 or rows.dim() != 2 or rows.shape[0] != 2 * total
                or scales is None or tuple(scales.shape) != (2 * total,) or set(tensors) != {"rows", "scales"}):
            raise ValueError(f"int8 predictor needs rows int8 (2*{total}, d) and scales ({2 * total},), got "
                             + ", ".join(f"{n} {t.dtype} {tuple(t.shape)}" for n, t in sorted(tensors.items())))

    def input_width(self, tensors):
        return tensors["rows"].shape[1]

    def flops(self, tensors):
        return 2 * tensors["rows"].numel()

    def graph_inputs(self, tensors, activation, dtype):
        return {"rows": tensors["rows"], "scales": tensors["scales"].to(torch.float32)}, {"activation": activation}


GLU_INT8 = register(GluInt8())
