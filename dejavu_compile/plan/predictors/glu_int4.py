"""Fitted int4 gate/up predictor ("glu_int4"): a 4-bit copy of a gated MLP's gate and up rows,
fitted to the calibration activations.

    codes: (2F, d/2) uint8, gate rows then up rows, two codes a byte (low nibble first, code + 8)
    scales: (2F, d/group) fp16, one per row and `group` input columns
    bias: (2F,) fp32, only with lookahead
    [g~, u~] = x dequant(codes, scales)^T + bias, scores = |act(g~) * u~|

With lookahead it reads the attention block's input (and then has the biases).
"""
from __future__ import annotations

import torch

from dejavu_compile import activations
from dejavu_compile.plan.predictors.linalg import one_thread, ridge_map
from dejavu_compile.plan.predictors.registry import FitInputs, PredictorKind, register

INT4_GROUP = 32  # input columns that share one scale


def glu_int4_scores(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                    activation: str = "silu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, d) -> (B, F) scores; the graph node the compiler inserts. The codes are unpacked and
    scaled to (2F, d) rows in `dtype` on every call (no int4 GEMV kernel yet), then one matmul.
    The unpacking is spelled out in uint8 nibbles rather than going through `dequantize_int4`'s
    int8 codes (same arithmetic): Inductor generates a faster decode step from this form."""
    rows, groups = scales.shape
    low, high = torch.bitwise_and(codes, 15), torch.bitwise_right_shift(codes, 4)
    nibbles = torch.stack([low, high], -1).reshape(rows, groups, -1)  # column 2j, then 2j + 1
    weight = ((nibbles.to(dtype) - 8) * scales.to(dtype).unsqueeze(-1)).reshape(rows, -1)
    h = torch.matmul(x, weight.t())
    if bias is not None:
        h = h + bias
    n = rows // 2
    return torch.abs(activations.torch_fn(activation)(h[..., :n]) * h[..., n:])


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

    Rounding each weight to its nearest 4-bit value ignores which input directions the text uses;
    here the rows are fitted to the collected inputs X instead: each weight column is rounded in
    turn and its rounding error, weighted by the inputs' second moments H = X^T X / N, is pushed onto
    the columns not yet rounded (GPTQ's error feedback, Frantar et al. 2022), which minimises the
    error of the pre-activations (W - Q) x on this text rather than of the weights. Symmetric 4-bit
    codes in [-7, 7], one fp16 scale per row and `group` input columns.

    With lookahead (`x_block` given: the block's own inputs, `x_in` another block's), the rows first
    become the least-squares map from [x_in, 1] to the block's pre-activations: W' = W S^T, bias
    b = W s (S, s fitted by ridge regression of `x_block` on `x_in`), and W' is fitted as above.

    Returns {"codes": (2F, d/2) uint8, "scales": (2F, d/group) fp16} (gate rows first), plus
    "bias": (2F,) fp32 with lookahead.
    """
    n, d = x_in.shape
    if d % group or d % 2:
        raise ValueError(f"the int4 predictor needs the block width ({d}) to be a multiple of its group ({group})")
    x = x_in.double()
    weights = torch.cat([gate_weight, up_weight]).detach().double()
    bias = None
    if x_block is not None:
        _, sol = ridge_map(x_in, x_block, ridge)  # [x_in, 1] -> x_block
        bias = (weights @ sol[d]).float()
        weights = weights @ sol[:d].T
    H = x.T @ x / n
    H += damp * H.diagonal().mean() * torch.eye(d, dtype=torch.float64)
    with one_thread():
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
    out = {"codes": pack_int4(codes), "scales": scales}
    if bias is not None:
        out["bias"] = bias
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
    """(2F, d) fp32 rows from packed codes and group scales."""
    codes = unpack_int4(packed).float()
    rows, d = codes.shape
    scales = scales.float()
    return (codes.view(rows, scales.shape[1], -1) * scales[:, :, None]).view(rows, d)


def int4_glu_rows(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """(2F, d) fp32 gate rows then up rows of fitted tensors `t` (without the bias)."""
    return dequantize_int4(t["codes"], t["scales"])


def int4_glu_scores(x: torch.Tensor, t: dict[str, torch.Tensor], activation: str = "silu") -> torch.Tensor:
    """(N, d) -> (N, F) scores of fitted tensors `t`, in fp32."""
    return GLU_INT4.scores(t, x, activation)


class GluInt4(PredictorKind):
    name = "glu_int4"
    v1_names = {"A": "codes", "a": "scales", "b": "bias"}
    quantized = needs_gate = True
    v1_code = "glu_int4"
    option, default_density = "int4", 0.6
    graph_scores = staticmethod(glu_int4_scores)

    def fit(self, data: FitInputs) -> dict[str, torch.Tensor]:
        return fit_int4_glu_predictor(data.x, data.gate, data.up, x_block=data.x_block if data.lookahead else None)

    def validate(self, tensors, total):
        rows = 2 * total
        codes, scales, bias = tensors.get("codes"), tensors.get("scales"), tensors.get("bias")
        ok = (codes is not None and codes.dtype == torch.uint8 and codes.dim() == 2 and codes.shape[0] == rows
              and scales is not None and scales.dim() == 2 and scales.shape[0] == rows and scales.shape[1] > 0
              and (2 * codes.shape[1]) % scales.shape[1] == 0 and (bias is None or tuple(bias.shape) == (rows,))
              and set(tensors) <= {"codes", "scales", "bias"})
        if not ok:
            raise ValueError(f"int4 predictor needs codes uint8 ({rows}, d/2), scales ({rows}, groups) and "
                             f"optional bias ({rows},), got "
                             + ", ".join(f"{n} {t.dtype} {tuple(t.shape)}" for n, t in sorted(tensors.items())))

    def input_width(self, tensors):
        return 2 * tensors["codes"].shape[1]

    def flops(self, tensors):
        return 2 * 2 * tensors["codes"].numel()  # two codes a byte

    def graph_inputs(self, tensors, activation, dtype):
        inputs = {"codes": tensors["codes"], "scales": tensors["scales"]}
        if "bias" in tensors:
            inputs["bias"] = tensors["bias"].to(dtype)
        return inputs, {"activation": activation, "dtype": dtype}


GLU_INT4 = register(GluInt4())
