"""``dejavu_compile.explain``: what the backend would match in a model, and what stays dense."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dejavu_compile.compiler.blocks import AttentionBlock, Block, MLPBlock
from dejavu_compile.compiler.isolated import isolated_compile


@dataclass
class ExplainReport:
    blocks: list[Block] = field(default_factory=list)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    layers: set[int] = field(default_factory=set)
    graphs: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _matched_layers(self, kind) -> set[int]:
        return {b.layer for b in self.blocks if isinstance(b, kind) and b.layer >= 0}

    @property
    def mlp_matched(self) -> int:
        return len(self._matched_layers(MLPBlock))

    @property
    def attention_matched(self) -> int:
        return len(self._matched_layers(AttentionBlock))

    def blocks_of_layer(self, layer: int) -> list[Block]:
        return [b for b in self.blocks if b.layer == layer]

    def __str__(self) -> str:
        lines = [f"dejavu explain: {self.graphs} graph(s), {self.num_layers} decoder layer(s); "
                 f"MLP matched in {self.mlp_matched}, attention matched in {self.attention_matched}",
                 f"{'layer':>5}  {'block':<9} {'rule':<14} details"]
        seen = set()
        for b in self.blocks:
            if isinstance(b, MLPBlock):
                key = (b.layer, "mlp", b.up.name)
                detail = (f"{'gated' if b.gated else 'plain'} {b.activation}, {b.hidden_size}->"
                          f"{b.intermediate_size}; up={b.up.describe()}"
                          + (f" gate={b.gate.describe()}" if b.gate else "") + f" down={b.down.describe()}")
            else:
                key = (b.layer, "attention", b.q.name)
                detail = (f"{b.num_heads}q/{b.num_kv_heads}kv heads x {b.head_dim} ({b.kv_sharing}), "
                          f"{b.attention}, rotary={b.rotary}, cache={b.cache}"
                          + (f", position bias={b.position_bias}" if b.position_bias != "none" else "")
                          + f"; q={b.q.describe()} "
                          f"o={b.o.describe()}")
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"{b.layer:>5}  {b.kind:<9} {b.rule:<14} {detail}")
        if self.fallbacks:
            lines.append("left dense:")
            lines.extend(f"  {where}: {why}" for where, why in self.fallbacks)
        else:
            lines.append("left dense: nothing")
        return "\n".join(lines)


def explain(model, *args, **kwargs) -> ExplainReport:
    """Trace ``model(*args, **kwargs)`` as the dejavu backend would and report the matched blocks.

    The model runs once under ``torch.no_grad()``; its outputs are discarded.
    """
    from dejavu_compile.compiler.passes.match import match_blocks

    report = ExplainReport()

    def capture(gm, example_inputs, **_):
        result = match_blocks(gm)
        report.graphs += 1
        report.blocks.extend(result.blocks)
        report.layers |= result.layers
        for entry in result.fallbacks:
            if entry not in report.fallbacks:
                report.fallbacks.append(entry)
        return gm.forward

    with isolated_compile(model, "dejavu_explain", backend=capture, dynamic=False) as compiled, torch.no_grad():
        compiled(*args, **kwargs)
    report.blocks.sort(key=lambda b: (b.layer, b.kind != "attention"))
    return report


def matched_blocks(model) -> list:
    """The blocks the backend matches in ``model``, traced once on two token ids (on the model's
    device); the trace leaves no graphs behind (``isolated.isolated_compile``)."""
    device = next(model.parameters()).device
    return explain(model, torch.tensor([[1, 2]], device=device)).blocks
