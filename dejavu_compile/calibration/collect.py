"""Calibration data through the matcher: block inputs and true neuron/head importance, any model.

The model is compiled with a recording backend: it matches blocks exactly as the dejavu backend
does and inserts recorder calls on the matched nodes (no per-architecture hooks), then runs the
graph eagerly. Tokens are subsampled uniformly, the same tokens for every block, so a block's
samples line up with the previous block's (the lookahead predictor's input).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx as fx

from dejavu_compile.compiler.blocks import AttentionBlock, MLPBlock


@dataclass
class LayerSamples:
    layer: int
    mlp_input: torch.Tensor | None = None  # (N, d) input of the MLP block
    mlp_importance: torch.Tensor | None = None  # (N, F) |act(gate) * up| or |act(up)|
    attn_input: torch.Tensor | None = None  # (N, d) input of the attention block
    attn_importance: torch.Tensor | None = None  # (N, H) norm of each head's output contribution


class _Recorder:
    """Receives tensors from the instrumented graph; keeps only the selected token rows."""

    def __init__(self):
        self.rows: torch.Tensor | None = None  # flat token indices kept from the current batch
        self.store: dict[tuple[int, str], list[torch.Tensor]] = {}

    def keep(self, key, value: torch.Tensor):
        flat = value.detach().reshape(-1, value.shape[-1]) if value.dim() > 1 else value.detach()[None]
        if self.rows is not None:
            flat = flat[self.rows]
        self.store.setdefault(key, []).append(flat.float().cpu())


_ACTIVE: list[_Recorder] = []


def _record(layer: int, name: str, value: torch.Tensor) -> None:
    _ACTIVE[-1].keep((layer, name), value)


def _record_abs(layer: int, name: str, value: torch.Tensor) -> None:
    _ACTIVE[-1].keep((layer, name), value.abs())


def head_contributions(o_input: torch.Tensor, o_weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(N, H*D) output-projection input and its (d, H*D) weight -> (N, H) norm of each head's
    contribution to the block output."""
    heads = o_input.reshape(-1, num_heads, o_input.shape[-1] // num_heads).float()
    weight = o_weight.float().reshape(o_weight.shape[0], num_heads, -1)
    return torch.einsum("nhj,dhj->nhd", heads, weight).norm(dim=-1)


def _record_heads(layer: int, o_input: torch.Tensor, o_weight: torch.Tensor, num_heads: int,
                  layout: str) -> None:
    """Norm of each head's contribution to the output projection, per token."""
    flat = o_input.reshape(-1, o_input.shape[-1])
    recorder = _ACTIVE[-1]
    if recorder.rows is not None:
        flat = flat[recorder.rows]
        recorder = _Passthrough(recorder)
    weight = o_weight if layout == "out_in" else o_weight.t()  # (d, H*D)
    recorder.keep((layer, "attn_importance"), head_contributions(flat, weight, num_heads))


class _Passthrough:
    def __init__(self, recorder):
        self.recorder = recorder

    def keep(self, key, value):
        self.recorder.store.setdefault(key, []).append(value.detach().float().cpu())


def _instrument(gm: fx.GraphModule, blocks) -> None:
    graph = gm.graph
    for block in blocks:
        layer = block.layer
        if isinstance(block, MLPBlock):
            taps = [(_record, block.nodes.input, "mlp_input"),
                    (_record_abs, block.nodes.hidden, "mlp_importance")]
            for fn, node, name in taps:
                with graph.inserting_after(node):
                    graph.call_function(fn, (layer, name, node))
        elif isinstance(block, AttentionBlock):
            node = block.nodes.input
            with graph.inserting_after(node):
                graph.call_function(_record, (layer, "attn_input", node))
            o_in = block.nodes.o_input
            with graph.inserting_after(o_in):
                graph.call_function(_record_heads, (layer, o_in, block.o.node, block.num_heads, block.o.layout))
    gm.recompile()


def collect(model, token_batches: Iterable[torch.LongTensor], max_tokens: int = 8192,
            progress: bool = True, seed: int = 0):
    """Run ``token_batches`` (each (1, T) input ids) through ``model``; return per-layer samples.

    Returns ``(samples, blocks)``: ``samples[layer]`` is a :class:`LayerSamples` with at most
    ``max_tokens`` rows (subsampled uniformly, the same rows for every block), and ``blocks`` the
    block records the matcher found.
    """
    from dejavu_compile.compiler.passes.match import match_blocks

    batches = list(token_batches)
    total = sum(b.numel() for b in batches)
    rate = min(1.0, max_tokens / max(total, 1))
    generator = torch.Generator().manual_seed(seed)
    found_blocks: dict[tuple[int, str], object] = {}

    def recording_backend(gm, example_inputs, **_):
        result = match_blocks(gm)
        for block in result.blocks:
            found_blocks.setdefault((block.layer, block.kind), block)
        _instrument(gm, result.blocks)
        return gm.forward

    recorder = _Recorder()
    compiled = torch.compile(model, backend=recording_backend, dynamic=True)
    iterator = batches
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(batches, desc="collecting block activations", unit="batch")
    _ACTIVE.append(recorder)
    try:
        with torch.no_grad():
            for ids in iterator:
                n = ids.numel()
                keep = max(1, math.ceil(n * rate))
                recorder.rows = torch.randperm(n, generator=generator)[:keep].sort().values if keep < n else None
                compiled(ids)
    finally:
        _ACTIVE.pop()
    if not found_blocks:
        raise ValueError("no decoder blocks were matched in this model; see dejavu_compile.explain(model, ...)")

    samples: dict[int, LayerSamples] = {}
    for (layer, name), parts in recorder.store.items():
        entry = samples.setdefault(layer, LayerSamples(layer))
        setattr(entry, name, torch.cat(parts)[:max_tokens])
    blocks = [found_blocks[k] for k in sorted(found_blocks, key=lambda k: (k[0], k[1] != "attention"))]
    return dict(sorted(samples.items())), blocks
