"""``quantize_weights``: a model's projections and embeddings stored as int8 with per-group scales, in place.

Each ``nn.Linear`` becomes an :class:`Int8Linear` holding its weight as int8 values with one fp32
scale per ``group_size`` weights of a row (symmetric, round to nearest: ``q = round(w / s)``,
``s = max|w| / 127`` over the group; llama.cpp's Q8_0 is the same scheme with fp16 scales). The
float weight is dropped, so resident memory falls to about a quarter of fp32's (half of bf16's),
and every call, decode and prefill, runs the C++ op ``dejavu::cpu_q8_linear``: at decode x quantized
to int16 per row, integer products summed per group, groups scaled and summed in fp32; a prompt's
many rows against fp32 blocks of the weight through torch's GEMM; the result in x's dtype. The op
is a graph node like any other, so ``torch.compile`` (the dejavu backend or Inductor) calls it
straight from the compiled step.

Inference only (the op has no backward); CPU only. The model's ``state_dict`` then holds each
projection's ``qweight`` and ``scales`` in place of its ``weight``: quantize after loading a
checkpoint, not before. A projection whose input width is not a
multiple of ``group_size`` keeps its float weight and is reported, as is any module that is not an
``nn.Linear`` (GPT-2's ``Conv1D``). Each plain ``nn.Embedding`` becomes an :class:`Int8Embedding`
(its looked-up rows decode to the float dtype it had; subclasses, which may scale or offset their
rows, keep their float weight and are reported); an embedding tied to the output head shares the
head's int8 values and scales, so the model holds one int8 copy where it held one float one.
Sparse plans reach the gated MLPs of int8 projections (``options={"mlp_density": ...}``, or a plan's
k per layer): each block's own int8 gate and up choose its kept neurons and give their values, and
only their rows of the down weight are read (``dejavu::cpu_q8_glu_mlp``); attention and the output
head stay dense, reported.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

FORMATS = ("int8",)
GROUP_SIZES = (32, 64, 128, 256)  # what the kernel takes: multiples of 32 up to 256


def quantize_rows_grouped(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """(n, d) float rows -> (int8 (n, d), fp32 scales (n, d // group_size)). A group of zeros gets
    scale 0 (its values decode to 0)."""
    n, d = weight.shape
    if d % group_size:
        raise ValueError(f"the rows' width {d} is not a multiple of group_size={group_size}")
    groups = weight.detach().float().reshape(n, d // group_size, group_size)
    scales = groups.abs().amax(-1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(groups / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, d).contiguous(), scales.contiguous()


def dequantize_rows_grouped(q: Tensor, scales: Tensor) -> Tensor:
    """The fp32 rows that quantize_rows_grouped's int8 values and scales stand for: (..., d) from
    (..., d) int8 and (..., d // group_size) scales."""
    return (q.unflatten(-1, (scales.shape[-1], -1)).float() * scales[..., None]).flatten(-2)


class Int8Linear(nn.Module):
    """An ``nn.Linear`` whose weight is int8 with per-group fp32 scales (buffers ``qweight`` and
    ``scales``); the bias stays in the model's dtype."""

    def __init__(self, linear: nn.Linear, group_size: int = 32):
        super().__init__()
        self.in_features, self.out_features, self.group_size = linear.in_features, linear.out_features, group_size
        q, scales = quantize_rows_grouped(linear.weight, group_size)
        self.register_buffer("qweight", q.to(linear.weight.device))
        self.register_buffer("scales", scales.to(linear.weight.device))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.dejavu.cpu_q8_linear(x, self.qweight, self.scales, self.bias)

    def dequantized(self) -> Tensor:
        """The fp32 weight the int8 values and scales stand for, (out_features, in_features)."""
        return dequantize_rows_grouped(self.qweight, self.scales)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int8, group_size={self.group_size}")


class Int8Embedding(nn.Module):
    """An ``nn.Embedding`` whose weight is int8 with per-group fp32 scales (buffers ``qweight`` and
    ``scales``, shared with the output head's :class:`Int8Linear` when the two were tied); the rows
    it looks up decode to ``dtype``, the float dtype of the weight it replaced."""

    def __init__(self, embedding: nn.Embedding, group_size: int = 32, int8_linear: Int8Linear | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.group_size, self.dtype = group_size, embedding.weight.dtype
        if int8_linear is not None:
            q, scales = int8_linear.qweight, int8_linear.scales
        else:
            q, scales = quantize_rows_grouped(embedding.weight, group_size)
        self.register_buffer("qweight", q.to(embedding.weight.device))
        self.register_buffer("scales", scales.to(embedding.weight.device))

    def forward(self, ids: Tensor) -> Tensor:
        return dequantize_rows_grouped(self.qweight[ids], self.scales[ids]).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8, group_size={self.group_size}"


@dataclass
class QuantizeReport:
    """What :func:`quantize_weights` did: the projections it replaced, those it kept (with why) and
    the bytes of the model's parameters and buffers before and after."""

    format: str
    group_size: int
    quantized: list[str] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0

    def __str__(self) -> str:
        lines = [f"{self.format} weights (groups of {self.group_size}): {len(self.quantized)} projections and "
                 f"embeddings, {self.bytes_before / 2**20:.1f} MiB -> {self.bytes_after / 2**20:.1f} MiB of "
                 "parameters and buffers"]
        lines += [f"  kept {name}: {why}" for name, why in self.kept]
        return "\n".join(lines)


def resident_bytes(model: nn.Module) -> int:
    """Bytes held by ``model``'s parameters and buffers, each storage counted once (tied weights share one)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def quantize_weights(model: nn.Module, format: str = "int8", *, group_size: int = 32) -> QuantizeReport:
    """Replace every ``nn.Linear`` and ``nn.Embedding`` of ``model`` by its int8 form (see the module
    docstring), in place; returns a :class:`QuantizeReport`. The model must be on the CPU and the C++ ops must build."""
    from dejavu_compile import kernels

    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    devices = {t.device.type for t in model.parameters()}
    if devices - {"cpu"}:
        raise ValueError(f"quantize_weights runs on CPU models, this one has parameters on {sorted(devices)}")
    if not kernels.cpu_ops_available():
        raise RuntimeError("quantize_weights needs the C++ CPU ops, which did not build (see the warning above)")
    report = QuantizeReport(format, group_size, bytes_before=resident_bytes(model))
    children = [(f"{name}.{child_name}" if name else child_name, module, child_name, child)
                for name, module in model.named_modules() for child_name, child in module.named_children()]
    int8_of_weight = {}  # id of a replaced float weight -> its Int8Linear (a tied embedding shares it)
    for full, module, child_name, child in children:
        if isinstance(child, nn.Linear):
            if child.in_features % group_size:
                report.kept.append((full, f"{child.in_features} inputs, not a multiple of {group_size}"))
                continue
            int8_of_weight[id(child.weight)] = Int8Linear(child, group_size)
            setattr(module, child_name, int8_of_weight[id(child.weight)])
            report.quantized.append(full)
        elif type(child).__name__ == "Conv1D":
            report.kept.append((full, "a Conv1D (weights stored (in, out)): not quantized"))
    for full, module, child_name, child in children:  # after the projections: a tied head's int8 is reused
        if type(child) is nn.Embedding:
            if child.embedding_dim % group_size or child.max_norm is not None:
                why = "max_norm renormalizes its rows" if child.max_norm is not None else \
                    f"{child.embedding_dim} wide, not a multiple of {group_size}"
                report.kept.append((full, why))
                continue
            setattr(module, child_name, Int8Embedding(child, group_size, int8_of_weight.get(id(child.weight))))
            report.quantized.append(full)
        elif isinstance(child, nn.Embedding):
            report.kept.append((full, f"a {type(child).__name__} (its own forward): not quantized"))
    report.bytes_after = resident_bytes(model)
    return report
