"""``dejavu::int8_linear``: the int8 predictor's GEMV, ``(x @ w_int8.T) * scale``.

The int8 predictor reads the block's own gate/up weights quantized per
row. On CPU fp32 the product runs in the C kernel of ``cpu/cpu_sparse_mlp.c`` (x quantized to int16
per row, integer multiply-adds): the same arithmetic as the backend's fused ``cpu_glu_int8_topk``,
so calibration, the masked simulation and the compiled decode step score neurons with the same
numbers. Without a C compiler it runs on FBGEMM's dynamic-quantization kernel (x quantized to 7
bits; weight packed once per tensor), which streams the int8 weight at memory bandwidth, faster than
an Inductor-generated loop or the fp32 weight. Either is approximate (the int8 weights' rounding),
which is what a predictor needs: its top-k selection is what matters, not the scores' last bits.
A bf16 or fp16 x on CPU goes through the C kernel too (cast to fp32; the result in x's dtype).
Elsewhere (CUDA, float64, no C compiler with a half dtype) the op is the plain matmul on the
dequantized weight.
"""
from __future__ import annotations

import warnings
import weakref

import torch
from torch import Tensor

from .cpu import native

_PACKED: dict[int, tuple] = {}  # id(w_int8) -> (weakref to w, version, id(scale), packed params)
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # x dtypes the C kernel takes (through fp32)
_FBGEMM = any(e in torch.backends.quantized.supported_engines for e in ("x86", "fbgemm"))


def quantize_rows_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(n, d) float rows -> ((n, d) int8, (n,) fp32 scales): symmetric, one scale per row."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def _packed(w: Tensor, scale: Tensor):
    """FBGEMM's packed weight for (w, scale), built once; None if this torch cannot (quantized
    tensors are deprecated upstream: when they go, the op falls back to the plain product)."""
    hit = _PACKED.get(id(w))
    if hit is not None and hit[0]() is w and hit[1] == w._version and hit[2] == id(scale):
        return hit[3]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the deprecation notice of quantized tensors, once per weight
            zero = torch.zeros(w.shape[0], dtype=torch.long)
            q = torch._make_per_channel_quantized_tensor(w, scale.double(), zero, 0)
            packed = torch.ops.quantized.linear_prepack(q, None)
    except (RuntimeError, AttributeError, NotImplementedError):
        global _FBGEMM
        _FBGEMM = False
        return None
    key = id(w)
    _PACKED[key] = (weakref.ref(w, lambda _: _PACKED.pop(key, None)), w._version, id(scale), packed)
    return packed


def _check(x: Tensor, w_int8: Tensor, scale: Tensor) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a (batch, d) floating tensor, got {x.dtype} {tuple(x.shape)}")
    if w_int8.dtype != torch.int8 or w_int8.dim() != 2 or w_int8.shape[1] != x.shape[1]:
        raise ValueError(f"w_int8 must be int8 (n, {x.shape[1]}), got {w_int8.dtype} {tuple(w_int8.shape)}")
    if scale.shape != (w_int8.shape[0],):
        raise ValueError(f"scale must be ({w_int8.shape[0]},), got {tuple(scale.shape)}")
    if not (x.device == w_int8.device == scale.device):
        raise ValueError(f"x, w_int8 and scale must share a device, got {x.device}, {w_int8.device}, {scale.device}")


@torch.library.custom_op("dejavu::int8_linear", mutates_args=())
def int8_linear(x: Tensor, w_int8: Tensor, scale: Tensor) -> Tensor:
    """(B, d) x (n, d) int8 with per-row scales (n,) -> (B, n) in x's dtype, approximately
    ``x @ (w_int8 * scale[:, None]).T`` (the C kernel on CPU fp32/bf16/fp16, FBGEMM on CPU fp32
    without it; exact dequantized matmul elsewhere)."""
    _check(x, w_int8, scale)
    if (x.device.type == "cpu" and x.dtype in _NATIVE_DTYPES and w_int8.is_contiguous() and scale.is_contiguous()
            and scale.dtype == torch.float32 and native.available()):
        # bf16/fp16 x is exact in fp32: the C kernel's arithmetic, rounded to x's dtype at the end
        return native.int8_linear_f32(x.float(), w_int8, scale).to(x.dtype)
    if x.device.type == "cpu" and x.dtype == torch.float32 and _FBGEMM:
        packed = _packed(w_int8, scale)
        if packed is not None:
            # reduce_range: 7-bit activations, so the int16 pair sums of non-VNNI AVX2 cannot saturate
            return torch.ops.quantized.linear_dynamic(x.contiguous(), packed, True)
    return (x @ w_int8.to(x.dtype).t()) * scale.to(x.dtype)


@int8_linear.register_fake
def _(x, w_int8, scale):
    _check(x, w_int8, scale)
    return x.new_empty(x.shape[0], w_int8.shape[0])
