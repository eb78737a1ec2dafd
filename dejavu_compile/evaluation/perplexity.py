"""Perplexity through the dejavu backend: the plan's own predictors, placement and top-k.

Sparse decoding handles one token per step; scoring a whole held-out text that way is slow, so
quality is measured with the backend's masked simulation (``simulate=True``): the same compiled
predictors (lookahead included) pick the same neurons per token, and the rest are zeroed before
the dense down projection. The sparse ops compute exactly that (tests/test_sparse_backend.py).
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F


def perplexity(model, chunks: Iterable[torch.LongTensor], plan=None, progress: bool = False) -> float:
    """Token-level perplexity of ``model`` on ``chunks`` ((1, T) ids each), dense or under ``plan``."""
    forward = model
    if plan is not None:
        torch._dynamo.reset()
        forward = torch.compile(model, backend="dejavu", dynamic=False,
                                options={"plan": plan, "simulate": True, "inner": "eager", "strict": True})
    chunks = list(chunks)
    iterator = chunks
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(chunks, desc="perplexity" + (" (dejavu)" if plan is not None else " (dense)"), unit="chunk")
    nll, count = 0.0, 0
    with torch.no_grad():
        for ids in iterator:
            logits = forward(ids, use_cache=False).logits[0, :-1].float()
            target = ids[0, 1:]
            nll += F.cross_entropy(logits, target, reduction="sum").item()
            count += target.numel()
    if plan is not None:
        torch._dynamo.reset()
    return math.exp(nll / max(count, 1))
