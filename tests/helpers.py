"""Builders the tests share: token ids, the int8 plan calibrate makes by default, another
checkpoint of the same architecture, teacher-forced decode logits over a static cache."""
from __future__ import annotations

import copy

import torch

from dejavu_compile.plan.predictors.glu_int8 import int8_glu_predictor
from dejavu_compile.plan.sparsity_plan import PlanEntry, SparsityPlan, model_fingerprint
from dejavu_compile.testing import _decode_logits


def token_ids(batch: int = 1, tokens: int = 6, seed: int = 0) -> torch.Tensor:
    """Random ids inside every tiny model's vocabulary (tiny configs have at least 128 tokens)."""
    return torch.randint(3, 120, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def int8_plan(model, density: float = 0.5, values: str = "predictor") -> SparsityPlan:
    """What calibrate makes by default on CPU for a LLaMA-style model: each MLP's own gate/up in
    int8 scoring its neurons, ``density`` of them kept."""
    entries = {}
    for layer, block in enumerate(model.model.layers):
        mlp = block.mlp
        total = mlp.gate_proj.weight.shape[0]
        entries[(layer, "mlp")] = PlanEntry(layer, "mlp", max(1, round(total * density)), total, "glu_int8",
                                            int8_glu_predictor(mlp.gate_proj.weight, mlp.up_proj.weight),
                                            "silu", lookahead=False, values=values)
    return SparsityPlan(entries, model_fingerprint(model))


def fine_tuned(model, scale: float = 0.05, seed: int = 1):
    """Another checkpoint of the same architecture: every matrix moved by ``scale`` of its spread."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
    return other


def decode_logits(forward, model, ids: torch.Tensor, tokens: list[torch.Tensor]) -> torch.Tensor:
    """Last-position logits of a prefill of ``ids`` through ``forward`` and of one decode step per
    token of ``tokens`` over a static cache of ``model``'s config: (1 + len(tokens), batch, vocab)."""
    with torch.no_grad():
        rows, _ = _decode_logits(forward, model, ids, tokens, len(tokens))
    return torch.stack(rows)


class ByteTokenizer:
    """Characters to ids inside the tiny vocabulary: what calibrate needs of a tokenizer."""

    eos_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 120 for c in text]}
