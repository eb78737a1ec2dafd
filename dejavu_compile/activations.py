"""The one table of MLP activations: every name, function and kernel code derives from it.

Each :class:`Activation` has
- ``name``: what matched blocks, plan entries and the sparse ops call it;
- ``aliases``: the names Hugging Face configs use for it (``hidden_act`` / ``hidden_activation``);
- ``fn``: the torch function (any dtype); matching compares traced graphs against it numerically;
- ``reference``: the float64 function tests compare kernels against (written independently of ``fn``);
- ``code``: the integer the C kernel, the C++ ops and the Triton kernels switch on. The C and C++
  sources get the codes and names from :func:`c_defines` at build time (``kernels/cpu/native.py``),
  the Triton kernel as ``tl.constexpr`` values read from this table (``kernels/triton/mlp.py``), so
  the names and numbers live here only.

Adding an activation: one entry here, plus one case in each kernel backend's activation function:
``activate`` in ``kernels/cpu/cpu_sparse_mlp.c`` (the C++ ops include that file) and ``_act`` in
``kernels/triton/mlp.py``. A missing case fails the C build and the Triton compile; the kernel tests
run every activation of this table against its ``reference``.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Activation:
    name: str
    aliases: tuple[str, ...]
    fn: Callable[[torch.Tensor], torch.Tensor]
    reference: Callable[[torch.Tensor], torch.Tensor]
    code: int


def gelu_tanh(t: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Gemma, GPT-2); a named function so FX graphs can call it."""
    return F.gelu(t, approximate="tanh")


def relu2(t: torch.Tensor) -> torch.Tensor:
    """Squared ReLU (Primer; Nemotron's "relu2"); a named function so FX graphs can call it."""
    return torch.relu(t).square()


def _gelu_reference(t: torch.Tensor) -> torch.Tensor:
    return 0.5 * t * (1.0 + torch.erf(t / math.sqrt(2.0)))


def _gelu_tanh_reference(t: torch.Tensor) -> torch.Tensor:
    return 0.5 * t * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (t + 0.044715 * t ** 3)))


BUILTIN: tuple[Activation, ...] = (
    Activation("silu", ("silu", "swish"), F.silu, lambda t: t / (1.0 + torch.exp(-t)), 0),
    Activation("gelu", ("gelu",), F.gelu, _gelu_reference, 1),
    Activation("gelu_tanh", ("gelu_tanh", "gelu_pytorch_tanh", "gelu_new", "gelu_fast"),
               gelu_tanh, _gelu_tanh_reference, 2),
    Activation("relu", ("relu",), F.relu, lambda t: t.clamp_min(0.0), 3),
    Activation("relu2", ("relu2", "relu_squared", "squared_relu"), relu2,
               lambda t: torch.where(t > 0, t * t, torch.zeros_like(t)), 4),
)

ACTIVATIONS: dict[str, Activation] = {a.name: a for a in BUILTIN}
NAMES: tuple[str, ...] = tuple(ACTIVATIONS)
_BY_ALIAS: dict[str, Activation] = {alias: a for a in BUILTIN for alias in (a.name, *a.aliases)}


def get(name: str) -> Activation:
    """The activation called ``name`` (its own name or a Hugging Face alias); ValueError otherwise."""
    try:
        return _BY_ALIAS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; known: {', '.join(NAMES)} "
                         f"(aliases: {', '.join(sorted(set(_BY_ALIAS) - set(NAMES)))})") from None


def canonical(name: str) -> str:
    """The table's name for ``name`` (e.g. "gelu_pytorch_tanh" -> "gelu_tanh")."""
    return get(name).name


def torch_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return get(name).fn


def c_defines() -> list[str]:
    """Compiler flags that give the C and C++ kernels the table: ``-DDEJAVU_ACT_SILU=0`` ... for the
    codes, and ``DEJAVU_ACTIVATIONS(X)``, an X-macro expanding to ``X(silu, SILU) X(gelu, GELU) ...``,
    from which the sources build what needs every entry (an enum to switch on, the C++ name lookup)."""
    entries = " ".join(f"X({a.name}, {a.name.upper()})" for a in BUILTIN)
    return [*(f"-DDEJAVU_ACT_{a.name.upper()}={a.code}" for a in BUILTIN), f"-DDEJAVU_ACTIVATIONS(X)={entries}"]
