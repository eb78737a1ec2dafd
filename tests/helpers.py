"""Builders the tests share: token ids, a byte tokenizer, random low-rank and int8 plans, another
checkpoint of the same architecture, teacher-forced decode logits over a static cache, greedy tokens
eager and through the backend, a calibrated tiny Nemotron, and a script run under the Triton
interpreter."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dejavu_compile.plan.predictors.glu_int8 import int8_glu_predictor
from dejavu_compile.plan.sparsity_plan import PlanEntry, SparsityPlan, model_fingerprint
from dejavu_compile.testing import _decode_logits

ROOT = Path(__file__).resolve().parents[1]


def token_ids(batch: int = 1, tokens: int = 6, seed: int = 0, *, low: int = 3, high: int = 120) -> torch.Tensor:
    """Random ids in [low, high), by default inside every tiny model's vocabulary (tiny configs have
    at least 128 tokens)."""
    return torch.randint(low, high, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def token_batches(n: int, tokens: int, seed: int = 1, *, low: int = 3, high: int = 120) -> list[torch.Tensor]:
    """``n`` random (1, tokens) sequences in [low, high), drawn one after another from one generator:
    calibration text for the tiny models."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (1, tokens), generator=g) for _ in range(n)]


class ByteTokenizer:
    """Characters to ids ``first`` .. ``first + count - 1`` (by default inside the tiny vocabulary):
    what calibrate and tokenize_chunks need of a tokenizer."""

    def __init__(self, first: int = 3, count: int = 120, eos_token_id: int = 2):
        self.first, self.count, self.eos_token_id = first, count, eos_token_id

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.first + ord(c) % self.count for c in text]}


class AlwaysSparseEntry(PlanEntry):
    """An entry that keeps every neuron but still goes through predictor, top-k and sparse op."""

    @property
    def dense(self):
        return False


def sparse_plan(model, density, *, entry_cls=PlanEntry, lookahead=True, rank=8, seed=0, attn_density=None,
                attn_entry_cls=None) -> SparsityPlan:
    """Random low-rank predictors keeping `density` of each MLP's neurons and `attn_density` of each
    attention block's heads (None: that kind stays dense)."""
    from dejavu_compile import explain

    report = explain(model, token_ids(1, 3))
    gen = torch.Generator().manual_seed(seed)
    d = model.config.hidden_size
    entries = {}
    for block in report.blocks:
        kind, total = (("mlp", block.intermediate_size) if block.kind == "mlp" else ("attention", block.num_heads))
        share = density if kind == "mlp" else attn_density
        if share is None:
            entries[(block.layer, kind)] = PlanEntry(block.layer, kind, total, total)
            continue
        cls = entry_cls if kind == "mlp" else (attn_entry_cls or entry_cls)
        entries[(block.layer, kind)] = cls(
            block.layer, kind, max(1, round(total * share)), total, "twolayer",
            {"in_proj": torch.randn(d, rank, generator=gen), "out_proj": torch.randn(rank, total, generator=gen)},
            lookahead=lookahead and (kind == "mlp" or block.layer > 0))
    return SparsityPlan(entries, model_fingerprint(model))


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


def greedy_step_tokens(model, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Eager's greedy tokens after ``ids``, one (batch, 1) tensor per decode step."""
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return [out[:, ids.shape[1] + i:ids.shape[1] + i + 1] for i in range(steps)]


def greedy_through_backend(model, ids: torch.Tensor, new_tokens: int = 6, options: dict | None = None):
    """(eager greedy tokens, the backend's greedy tokens, the backend's reports) over a static cache."""
    from dejavu_compile.testing import greedy_generate

    reports = []
    expected = greedy_generate(model, ids, new_tokens=new_tokens, cache="static")
    actual = greedy_generate(model, ids, new_tokens=new_tokens, cache="static",
                             dejavu_options={**(options or {}), "on_report": reports.append})
    torch._dynamo.reset()
    return expected, actual, reports


def calibrated_nemotron(vocab: int = 128):
    """A tiny Nemotron (squared-ReLU MLPs) and its calibrated plan at 50% MLP density (Deja Vu's
    two-layer predictor)."""
    from dejavu_compile.calibration.calibrate import calibrate
    from dejavu_compile.calibration.collect import collect
    from dejavu_compile.testing.tiny import tiny_model

    model = tiny_model("nemotron", vocab=vocab)
    samples, _ = collect(model, token_batches(4, 32, high=vocab), progress=False)
    plan = calibrate(model, None, samples=samples, mlp_density=0.5, progress=False, dense_when_unprofitable=False)
    return model, plan


def run_under_triton_interpreter(script: str) -> str:
    """Run ``script`` in a fresh process with TRITON_INTERPRET=1 (it must be set before the Triton
    kernels are first imported); its stdout, after asserting it exited cleanly."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "DEJAVU_TRITON_AUTOTUNE": "0", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout
