"""The table of predictor kinds: what a plan entry's ``predictor`` name means.

A kind owns everything about one predictor form: how it is fitted at calibration, its tensors'
names and shapes (checked on load), its scores in eager code and in a compiled graph, the bytes it
reads per token, and the calibration settings it comes with (the ``calibrate(predictor=...)`` alias
it answers to, its default density, lookahead and allocation). Plan entries, the compiler,
calibration and the command line ask the kind; none of them switch on kind or tensor names.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass
class FitInputs:
    """What calibration hands a kind to fit one block's predictor (validation rows excluded)."""

    x: torch.Tensor  # (N, d) the predictor's input: the block's own, or the earlier block's with lookahead
    x_block: torch.Tensor  # (N, d) the block's own input
    importance: torch.Tensor  # (N, F) |activation| of every neuron
    gate: torch.Tensor | None  # (F, d) fp32 gate rows (gated MLPs)
    up: torch.Tensor  # (F, d) fp32 up rows
    k: int  # target number of kept neurons (trained kinds aim their loss at it)
    rank: int
    steps: int
    seed: int
    lookahead: bool


class PredictorKind:
    """One predictor form. Subclasses set the class attributes and implement the methods."""

    name: ClassVar[str]
    v1_names: ClassVar[dict[str, str]] = {}  # format-1 tensor names ("A", "B", "a", "b") -> this kind's
    quantized: ClassVar[bool] = False  # tensors kept and read as stored (codes, scales); else model dtype
    needs_gate: ClassVar[bool] = False  # models a gated MLP's gate and up projections
    needs_own_input: ClassVar[bool] = False  # is the block's own projection: reads its input (no lookahead)
    gives_values: ClassVar[bool] = False  # `graph_values` is the block's act(gate) * up (values "predictor")
    int8_rows: ClassVar[bool] = False  # tensors are the layout of the fused C++ int8 ops (int8_operands)
    training_free: ClassVar[bool] = False  # `from_weights` builds it from gate/up alone (the mlp_density option)
    for_heads: ClassVar[bool] = False  # the kind calibrate fits to attention heads
    v1_code: ClassVar[str | None] = None  # the plan format-1 "nonlinearity" that meant this kind
    # Calibration settings. `option`: the calibrate(predictor=...) / --predictor alias this kind serves,
    # for gated MLPs if it `needs_gate`, else for plain ones (one alias may name one kind of each).
    option: ClassVar[str | None] = None
    default_density: ClassVar[float] = 0.6  # calibrate's mlp_density when the caller gives none
    default_lookahead: ClassVar[bool] = False  # lookahead when the caller gives none (never with needs_own_input)
    auto_devices: ClassVar[tuple[str, ...]] = ()  # devices where its alias is calibrate's automatic choice
    # Plain torch functions (x2d, **tensors, **options) -> (B, F) that the compiler inserts as one
    # graph node each (AOTAutograd traces through them). Module-level functions held as
    # staticmethods, so FX code can name them.
    graph_scores: Callable[..., torch.Tensor]
    graph_values: Callable[..., torch.Tensor] | None = None  # signed act(g~) * u~, where gives_values

    def fit(self, data: FitInputs) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def fit_heads(self, x: torch.Tensor, importance: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        """The head predictor (``for_heads`` kinds): from inputs (N, d) and per-head importance (N, H)."""
        raise NotImplementedError(f"predictor {self.name!r} is not fitted to attention heads")

    def validate(self, tensors: dict[str, torch.Tensor], total: int) -> None:
        """Raise ValueError saying what is wrong with the tensors of an entry of `total` outputs."""
        raise NotImplementedError

    def input_width(self, tensors: dict[str, torch.Tensor]) -> int:
        """Features the predictor reads (the width of its input)."""
        raise NotImplementedError

    def flops(self, tensors: dict[str, torch.Tensor]) -> int:
        """Multiply-adds x2 per token."""
        raise NotImplementedError

    def from_weights(self, gate: torch.Tensor, up: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors of a ``training_free`` kind, from a gated MLP's (F, d) gate and up rows."""
        raise NotImplementedError

    def int8_operands(self, nodes: dict):
        """The (2F, d) int8 rows and (2F,) fp32 scales of an ``int8_rows`` kind, from its tensors (or
        the graph nodes holding them) by name: the operands of the fused C++ int8 ops."""
        raise NotImplementedError

    @property
    def default_allocation(self) -> str:
        """The quantized kinds are near the oracle in every layer: uniform beats greedy for them."""
        return "uniform" if self.quantized else "greedy"

    def graph_inputs(self, tensors: dict[str, torch.Tensor], activation: str,
                     dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors as the graph functions take them in a model of `dtype`, their other keyword arguments)."""
        if self.quantized:
            raise NotImplementedError
        return {n: t.to(dtype) for n, t in tensors.items()}, {}

    # ------------------------------------------------------------------ derived from the above
    def scores(self, tensors: dict[str, torch.Tensor], x: torch.Tensor, activation: str) -> torch.Tensor:
        """(..., d) -> (..., F) scores (higher = keep), eagerly, with the graph's arithmetic: quantized
        kinds in fp32, others in x's floating dtype."""
        dtype = torch.float32 if self.quantized or not x.dtype.is_floating_point else x.dtype
        inputs, options = self.graph_inputs(tensors, activation, dtype)
        inputs = {n: t.to(x.device) for n, t in inputs.items()}
        flat = x.reshape(-1, x.shape[-1]).to(dtype)
        return self.graph_scores(flat, **inputs, **options).view(*x.shape[:-1], -1)

    def read_bytes(self, tensors: dict[str, torch.Tensor], element_size: int) -> int:
        """Bytes read per token in a model whose weights take `element_size` bytes: quantized kinds'
        tensors as stored, others' in the model's dtype (the backend casts them to it)."""
        if self.quantized:
            return sum(t.numel() * t.element_size() for t in tensors.values())
        return sum(t.numel() for t in tensors.values()) * element_size

    def storage(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor as the plan file keeps it."""
        return tensor.detach() if self.quantized else tensor.detach().float()

    def fits_block(self, tensors: dict[str, torch.Tensor], gated: bool | None, width: int | None) -> str | None:
        """Why this predictor cannot serve a block (None when it can): gated or not, input width."""
        if self.needs_gate and gated is False:
            return "quantized gate/up predictor but the block has no gate" if self.quantized else \
                "gate/up predictor but the block has no gate"
        reads = self.input_width(tensors)
        if width is not None and reads != width:
            return f"predictor reads {reads} features, the block input has {width}"
        return None


_KINDS: dict[str, PredictorKind] = {}


def register(kind: PredictorKind) -> PredictorKind:
    """Add a kind to the table under ``kind.name``."""
    if kind.name in _KINDS and type(_KINDS[kind.name]) is not type(kind):
        raise ValueError(f"predictor kind {kind.name!r} is already registered")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind from the table (a kind a test or a plug-in registered for a while)."""
    get(name)
    del _KINDS[name]


def get(name: str) -> PredictorKind:
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"unknown predictor kind {name!r} (known: {', '.join(sorted(_KINDS))})") from None


def names() -> tuple[str, ...]:
    return tuple(_KINDS)


def option_names() -> tuple[str, ...]:
    """The ``calibrate(predictor=...)`` aliases, in registration order."""
    return tuple(dict.fromkeys(k.option for k in _KINDS.values() if k.option is not None))


def option_kinds(option: str) -> tuple[PredictorKind | None, PredictorKind | None]:
    """(the kind an alias fits to gated MLPs, the kind it fits to plain ones); either may be None."""
    if option not in option_names():
        raise ValueError(f"predictor must be 'auto' or one of {list(option_names())}, got {option!r}")
    serving = [k for k in _KINDS.values() if k.option == option]
    gated = next((k for k in serving if k.needs_gate), None)
    plain = next((k for k in serving if not k.needs_gate), None)
    return gated or plain, plain


def auto_option(device_type: str, all_gated: bool) -> str:
    """calibrate's predictor="auto": the first alias that is automatic on this device and serves
    every MLP of the model, else the first that serves gated and plain MLPs alike."""
    usable = [o for o in option_names() if all_gated or option_kinds(o)[1] is not None]
    preferred = [o for o in usable if device_type in option_kinds(o)[0].auto_devices]
    general = [o for o in usable if option_kinds(o)[1] is not None]
    if not (preferred or general):
        raise ValueError("no registered predictor kind serves this model's MLPs")
    return (preferred or general)[0]


def head_kind() -> PredictorKind:
    return next(k for k in _KINDS.values() if k.for_heads)


def training_free_kind() -> PredictorKind:
    return next(k for k in _KINDS.values() if k.training_free)


def v1_kind(code: str) -> str | None:
    """The kind a plan format-1 "nonlinearity" meant ("dense": none)."""
    if code == "dense":
        return None
    for k in _KINDS.values():
        if k.v1_code == code:
            return k.name
    raise ValueError(f"unknown nonlinearity {code!r}")
