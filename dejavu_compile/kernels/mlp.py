"""Neuron-sparse MLP ops: ``dejavu::sparse_gated_mlp`` and ``dejavu::sparse_mlp``.

Both compute, for each row b of x, only the intermediate neurons listed in idx[b] (or in a shared
idx), reading only those rows of the weights:

    gated:  y_b = sum_{j in idx[b]} act(w_gate[j].x_b + b_gate[j]) * (w_up[j].x_b + b_up[j]) * w_down_t[j] + b_down
    plain:  y_b = sum_{j in idx[b]} act(w_up[j].x_b + b_up[j]) * w_down_t[j] + b_down

``w_down_t`` is the down projection's weight transposed, stored contiguous (F, d), so a neuron's
down column is one contiguous row (see ``prepare.py``).

Backends, chosen per call by device and dtype:
- CPU fp32: the C kernel (``cpu/cpu_sparse_mlp.c``, built on first use by ``cpu/native.py``), one
  pass over the selected neurons reading each one's gate, up and down rows back to back;
- CPU, other dtypes (or no C compiler, or ``DEJAVU_CPU_NATIVE=0``): torch (``torch_impl.py``);
- CUDA: Triton (``triton/mlp.py``, imported on first CUDA call).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _common as C
from . import torch_impl
from .cpu import native


@torch.no_grad()
def _mlp_cpu(x, w_a, w_b, w_down_t, idx, activation, b_a, b_b, b_down, out=None) -> Tensor:
    """The C kernel where it applies, else torch; w_b None for the plain MLP. Writes every element of
    `out`. Inference only, like the ops (no autograd formula): weights may be grad-enabled parameters."""
    if native.applies(x, [w_a, w_b, w_down_t, b_a, b_b, b_down], idx):
        if out is not None and not out.is_contiguous():
            return out.copy_(native.sparse_mlp_f32(x, w_a, w_b, w_down_t, idx, activation, b_a, b_b, b_down))
        return native.sparse_mlp_f32(x, w_a, w_b, w_down_t, idx, activation, b_a, b_b, b_down, out)
    return torch_impl.sparse_mlp(x, w_a, w_b, w_down_t, idx, activation, b_a, b_b, b_down, out)


def sparse_gated_mlp_torch(x, w_gate, w_up, w_down_t, idx, activation, b_gate=None, b_up=None,
                           b_down=None, *, out: Optional[Tensor] = None, check_idx: bool = True) -> Tensor:
    """The CPU implementation of ``sparse_gated_mlp`` (checks included; ``out`` for tests)."""
    C.check_mlp(x, w_gate, w_up, w_down_t, idx, activation, b_gate, b_up, b_down, "w_gate", "w_up")
    if check_idx:
        C.check_idx_range("idx", idx, w_gate.shape[0])
    return _mlp_cpu(x, w_gate, w_up, w_down_t, idx, activation, b_gate, b_up, b_down, out)


def sparse_mlp_torch(x, w_up, b_up, w_down_t, b_down, idx, activation, *,
                     out: Optional[Tensor] = None, check_idx: bool = True) -> Tensor:
    """The CPU implementation of ``sparse_mlp`` (checks included; ``out`` for tests)."""
    C.check_mlp(x, w_up, None, w_down_t, idx, activation, b_up, None, b_down, "w_up", None)
    if check_idx:
        C.check_idx_range("idx", idx, w_up.shape[0])
    return _mlp_cpu(x, w_up, None, w_down_t, idx, activation, b_up, None, b_down, out)


# ---------------------------------------------------------------------------------------------
# custom ops


@torch.library.custom_op("dejavu::sparse_gated_mlp", mutates_args=())
def sparse_gated_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down_t: Tensor, idx: Tensor,
                     activation: str, b_gate: Optional[Tensor] = None, b_up: Optional[Tensor] = None,
                     b_down: Optional[Tensor] = None, check_idx: bool = True) -> Tensor:
    """y = sum over j in idx of act(w_gate[j].x + b_gate[j]) * (w_up[j].x + b_up[j]) * w_down_t[j] + b_down.

    x (B, d); w_gate, w_up (F, d); w_down_t (F, d_out); idx int64 (k,) shared or (B, k) per row;
    activation one of ``ACTIVATIONS`` (the activation table's names); biases optional. Returns (B, d_out).
    check_idx=False skips the idx range check, which reads idx (a device sync on CUDA, impossible
    inside a CUDA-graph capture); the backend passes False because its idx come from topk.
    """
    return sparse_gated_mlp_torch(x, w_gate, w_up, w_down_t, idx, activation, b_gate, b_up, b_down,
                                  check_idx=check_idx)


@sparse_gated_mlp.register_kernel("cuda")
def _(x, w_gate, w_up, w_down_t, idx, activation, b_gate=None, b_up=None, b_down=None, check_idx=True):
    C.check_mlp(x, w_gate, w_up, w_down_t, idx, activation, b_gate, b_up, b_down, "w_gate", "w_up")
    if check_idx:
        C.check_idx_range("idx", idx, w_gate.shape[0])
    from .triton import mlp as triton_mlp
    return triton_mlp.sparse_gated_mlp_triton(x, w_gate, w_up, w_down_t, idx, activation,
                                              b_gate, b_up, b_down, check=False)


@sparse_gated_mlp.register_fake
def _(x, w_gate, w_up, w_down_t, idx, activation, b_gate=None, b_up=None, b_down=None, check_idx=True):
    C.check_mlp(x, w_gate, w_up, w_down_t, idx, activation, b_gate, b_up, b_down, "w_gate", "w_up")
    return x.new_empty(x.shape[0], w_down_t.shape[1])


@torch.library.custom_op("dejavu::sparse_mlp", mutates_args=())
def sparse_mlp(x: Tensor, w_up: Tensor, b_up: Optional[Tensor], w_down_t: Tensor,
               b_down: Optional[Tensor], idx: Tensor, activation: str, check_idx: bool = True) -> Tensor:
    """y = sum over j in idx of act(w_up[j].x + b_up[j]) * w_down_t[j] + b_down (OPT, GPT-2).

    x (B, d); w_up (F, d); w_down_t (F, d_out); b_up (F,) / b_down (d_out,) or None;
    idx int64 (k,) or (B, k); check_idx as in ``sparse_gated_mlp``. Returns (B, d_out).
    """
    return sparse_mlp_torch(x, w_up, b_up, w_down_t, b_down, idx, activation, check_idx=check_idx)


@sparse_mlp.register_kernel("cuda")
def _(x, w_up, b_up, w_down_t, b_down, idx, activation, check_idx=True):
    C.check_mlp(x, w_up, None, w_down_t, idx, activation, b_up, None, b_down, "w_up", None)
    if check_idx:
        C.check_idx_range("idx", idx, w_up.shape[0])
    from .triton import mlp as triton_mlp
    return triton_mlp.sparse_mlp_triton(x, w_up, b_up, w_down_t, b_down, idx, activation, check=False)


@sparse_mlp.register_fake
def _(x, w_up, b_up, w_down_t, b_down, idx, activation, check_idx=True):
    C.check_mlp(x, w_up, None, w_down_t, idx, activation, b_up, None, b_down, "w_up", None)
    return x.new_empty(x.shape[0], w_down_t.shape[1])
