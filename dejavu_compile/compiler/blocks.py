"""Typed records for the decoder blocks the matcher finds in a traced graph.

A record names every weight by its parameter path in the user's model (so a plan can be keyed by it
and checked against it) and keeps the FX nodes of the region it covers (so passes can rewrite it).
A user rule fills the same records: the passes read nothing else (``MLPNodes``, ``AttentionNodes``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx


@dataclass
class WeightRef:
    """One projection weight as the graph uses it.

    ``layout`` is "out_in" for ``nn.Linear`` weights (out, in) and "in_out" for GPT-2 ``Conv1D``
    weights (in, out). ``rows`` is the slice of the output dimension this role owns when the weight
    is fused (q/k/v in ``c_attn``, gate/up in ``gate_up_proj``); None when the role owns it all.
    """

    name: str
    layout: str = "out_in"
    rows: tuple[int, int] | None = None
    bias: str | None = None
    node: fx.Node | None = field(default=None, repr=False, compare=False)
    bias_node: fx.Node | None = field(default=None, repr=False, compare=False)
    # quantize_weights' int8 projections: ``name``/``node`` are the int8 values, these their scales
    scales: str | None = None
    scales_node: fx.Node | None = field(default=None, repr=False, compare=False)

    @property
    def int8(self) -> bool:
        return self.scales is not None

    def describe(self) -> str:
        text = self.name
        if self.rows is not None:
            text += f"[{self.rows[0]}:{self.rows[1]}]"
        if self.layout == "in_out":
            text += " (Conv1D)"
        if self.int8:
            text += " (int8)"
        return text


@dataclass
class MLPNodes:
    """The FX nodes of one MLP block that the sparse passes rewrite and calibration taps."""

    input: fx.Node  # x, the tensor gate and up read (..., d)
    hidden: fx.Node  # act(gate(x)) * up(x) (or act(up(x))): the down projection's input (..., F)
    output: fx.Node  # the block's output, down(hidden), as the model uses it
    down: fx.Node  # the down projection's call (linear / addmm / matmul)
    up: fx.Node  # the up projection's call
    gate: fx.Node | None = None  # the gate projection's call (None for a plain MLP)


@dataclass
class AttentionNodes:
    """The FX nodes of one self-attention block that the sparse passes rewrite and calibration taps."""

    input: fx.Node  # x, the tensor q, k and v read (..., d)
    # the attention output: (B, H, T, D), or (B * H, T, D) when eager attention folds heads into the batch axis
    core: fx.Node
    o_input: fx.Node  # what the output projection reads: the heads as (..., H * D)
    o: fx.Node  # the output projection's call
    output: fx.Node  # the block's output, o(o_input)
    q: fx.Node  # the query projection's call
    k: fx.Node  # the key projection's call
    v: fx.Node  # the value projection's call
    q_x: fx.Node  # the query projection's input (x, or a view of it)
    q_out: fx.Node  # the query projection's output, before the head reshape
    # per role, the weight rows each head owns: an int64 (heads, head_dim) table into the projection's output
    head_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    position_bias: fx.Node | None = None  # the ALiBi bias added to the scores, or None


@dataclass
class MLPBlock:
    """``down(act(gate(x)) * up(x))`` (gated) or ``down(act(up(x)))`` (plain)."""

    layer: int
    rule: str
    gated: bool
    activation: str
    up: WeightRef
    down: WeightRef
    gate: WeightRef | None
    hidden_size: int
    intermediate_size: int
    decode: bool  # one token per sequence
    tokens: int  # tokens per sequence in this graph
    batch: int
    module: str = ""
    nodes: MLPNodes | None = field(default=None, repr=False, compare=False)
    kind: str = "mlp"

    @property
    def weights(self) -> dict[str, WeightRef]:
        roles = {"up": self.up, "down": self.down}
        if self.gate is not None:
            roles["gate"] = self.gate
        return roles


@dataclass
class AttentionBlock:
    """Projections, heads, rotary, cache update and attention of one self-attention block."""

    layer: int
    rule: str
    q: WeightRef
    k: WeightRef
    v: WeightRef
    o: WeightRef
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary: str  # "none" | "full" | "partial"
    qk_norm: str  # "none" | "per_head" | "across_heads"
    cache: str  # "none" | "cat" (DynamicCache) | "index_copy" (StaticCache)
    attention: str  # "sdpa" | "eager"
    kv_sharing: str  # "mha" | "gqa" | "mqa"
    decode: bool
    tokens: int
    batch: int
    module: str = ""
    # "alibi": the scores get an additive bias with one slice per query head (ALiBi: BLOOM, MPT,
    # Falcon); heads stay independent, so dropping one drops its bias too. "none" otherwise.
    position_bias: str = "none"
    nodes: AttentionNodes | None = field(default=None, repr=False, compare=False)
    kind: str = "attention"

    @property
    def weights(self) -> dict[str, WeightRef]:
        return {"q": self.q, "k": self.k, "v": self.v, "o": self.o}


Block = MLPBlock | AttentionBlock
