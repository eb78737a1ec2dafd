"""Perplexity through the dejavu backend: the plan's own predictors, placement and top-k.

Sparse decoding handles one token per step; scoring a whole held-out text that way is slow, so
quality is measured with the backend's masked simulation (``simulate=True``): the same compiled
predictors (lookahead included) pick the same neurons per token, and the rest are zeroed before
the dense down projection. The sparse ops compute exactly that (tests/test_sparse_backend.py).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from dejavu_compile.compiler.isolated import isolated_compile


def perplexity(model, chunks: Iterable[torch.LongTensor], plan=None, progress: bool = False) -> float:
    """Token-level perplexity of ``model`` on ``chunks`` ((1, T) ids each), dense or under ``plan``.
    The plan's compiled graphs are the evaluation's own (``compiler.isolated``): the user's compiled
    functions and the model's recompile budget are left alone."""
    chunks = list(chunks)
    if plan is None:
        return _perplexity(model, chunks, "dense", progress)
    options = {"plan": plan, "simulate": True, "inner": "eager", "strict": True}
    with isolated_compile(model, "dejavu_perplexity_forward", backend="dejavu", dynamic=False,
                          options=options) as forward:
        return _perplexity(forward, chunks, "dejavu", progress)


def _perplexity(forward, chunks: list, label: str, progress: bool) -> float:
    iterator = chunks
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(chunks, desc=f"perplexity ({label})", unit="chunk")
    nll, count = 0.0, 0
    with torch.no_grad():
        for ids in iterator:
            logits = forward(ids, use_cache=False).logits[0, :-1].float()
            target = ids[0, 1:]
            nll += F.cross_entropy(logits, target, reduction="sum").item()
            count += target.numel()
    return math.exp(nll / max(count, 1))
