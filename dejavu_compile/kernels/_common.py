"""Argument checks, activations and buffer allocation shared by the sparse ops and their backends.

Checks on shapes, dtypes and devices only look at metadata, so the fake kernels run them too (a bad
call fails at compile time). Checks on index *values* need real data: only the real kernels run them.
"""
from __future__ import annotations

import torch

from dejavu_compile import activations as _table

# The ops take the table's own names (callers map Hugging Face aliases with activations.canonical).
ACTIVATIONS: tuple[str, ...] = _table.NAMES
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Set to False to skip the idx range check (it syncs with the device; a CUDA-graph capture needs
# it off). Shape/dtype/device checks always run.
CHECK_INDICES = True

# Tests set this to True so every internal buffer starts as NaN and a missed write shows up.
POISON_BUFFERS = False


def empty(*shape, dtype, device) -> torch.Tensor:
    """torch.empty, or a NaN-filled buffer when POISON_BUFFERS is set (tests)."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    if POISON_BUFFERS:
        t.fill_(float("nan") if t.is_floating_point() else -1)
    return t


def activate(t: torch.Tensor, activation: str) -> torch.Tensor:
    """The table's torch function for ``activation`` (one of ACTIVATIONS)."""
    check_activation(activation)
    return _table.ACTIVATIONS[activation].fn(t)


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def check_tensor(name: str, t, ndim: int | tuple[int, ...], ref: torch.Tensor, *, float_=True) -> None:
    """``t`` is a tensor of rank ``ndim`` on ``ref``'s device (and of ``ref``'s dtype if float_)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if t.dim() not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dims, got shape {tuple(t.shape)}")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but x is on {ref.device}")
    if float_ and t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but x has dtype {ref.dtype}")


def check_shape(name: str, t: torch.Tensor, expected: tuple) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def check_x(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be (batch, features), got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be a floating tensor, got {x.dtype}")


def check_idx(name: str, idx, batch: int, ref: torch.Tensor) -> None:
    """idx is int64, (k,) shared by all rows or (batch, k) per row, with k >= 1."""
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype != torch.int64:
        raise TypeError(f"{name} must be int64, got {idx.dtype}")
    if idx.device != ref.device:
        raise ValueError(f"{name} is on {idx.device} but x is on {ref.device}")
    if idx.dim() == 2:
        if idx.shape[0] != batch:
            raise ValueError(f"{name} is per row with {idx.shape[0]} rows but x has batch {batch}")
    elif idx.dim() != 1:
        raise ValueError(f"{name} must be (k,) or (batch, k), got shape {tuple(idx.shape)}")
    if idx.shape[-1] == 0:
        raise ValueError(f"{name} selects nothing (k == 0)")


def check_idx_range(name: str, idx: torch.Tensor, size: int) -> None:
    """Value check: real tensors only (never in a fake kernel)."""
    if not CHECK_INDICES:
        return
    lo, hi = torch.aminmax(idx)
    if int(lo) < 0 or int(hi) >= size:
        raise ValueError(f"{name} has values in [{int(lo)}, {int(hi)}], outside [0, {size})")


def rows_2d(idx: torch.Tensor, batch: int) -> torch.Tensor:
    """(batch, k) view of idx, expanded (not copied) when it is shared."""
    return idx.expand(batch, -1) if idx.dim() == 1 else idx


def check_mlp(x, w_a, w_b, w_down_t, idx, activation, b_a, b_b, b_down, a_name, b_name) -> None:
    """The sparse MLP ops' arguments (w_b None: plain MLP; a_name/b_name: the caller's weight names)."""
    check_x(x)
    check_activation(activation)
    check_tensor(a_name, w_a, 2, x)
    n_neurons, d = w_a.shape
    if d != x.shape[1]:
        raise ValueError(f"{a_name} has {d} input features but x has {x.shape[1]}")
    if w_b is not None:
        check_tensor(b_name, w_b, 2, x)
        check_shape(b_name, w_b, (n_neurons, d))
    check_tensor("w_down_t", w_down_t, 2, x)
    if w_down_t.shape[0] != n_neurons:
        raise ValueError(f"w_down_t must be (F={n_neurons}, d_out) (the down weight transposed), "
                         f"got shape {tuple(w_down_t.shape)}")
    for name, bias, size in (("b_gate" if w_b is not None else "b_up", b_a, n_neurons),
                             ("b_up", b_b, n_neurons), ("b_down", b_down, w_down_t.shape[1])):
        if bias is not None:
            check_tensor(name, bias, 1, x)
            check_shape(name, bias, (size,))
    check_idx("idx", idx, x.shape[0], x)
    if idx.shape[-1] > n_neurons:
        raise ValueError(f"idx selects {idx.shape[-1]} neurons but there are only {n_neurons}")
