"""Typed records for the decoder blocks the matcher finds in a traced graph.

A record names every weight by its parameter path in the user's model (so a plan can be keyed by it
and checked against it) and keeps the FX nodes of the region it covers (so passes can rewrite it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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

    def describe(self) -> str:
        text = self.name
        if self.rows is not None:
            text += f"[{self.rows[0]}:{self.rows[1]}]"
        if self.layout == "in_out":
            text += " (Conv1D)"
        return text


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
    # FX nodes: "input" (x), "hidden" (input of the down projection), "output" (the block's output).
    nodes: dict[str, fx.Node] = field(default_factory=dict, repr=False, compare=False)
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
    # FX nodes: "input", "core" (the attention output: (B, H, T, D), or (B * H, T, D) when eager
    # attention folds the heads into the batch axis), "o_input", "output", "position_bias" (or None)...
    nodes: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    kind: str = "attention"

    @property
    def weights(self) -> dict[str, WeightRef]:
        return {"q": self.q, "k": self.k, "v": self.v, "o": self.o}


Block = MLPBlock | AttentionBlock
