"""``greedy_decode``: greedy generation over a static cache with nothing between two decode steps but
the model call and an argmax.

``model.generate`` runs Python around each forward call (logits processors, stopping criteria,
keyword bookkeeping), a visible share of a small model's step once the step itself is fast
(``benchmarks/peers.py`` measures both loops on the same compiled forward). This
loop gives the same tokens as ``generate(do_sample=False, cache_implementation="static")`` for
decoder-only Hugging Face models without padding.
"""
from __future__ import annotations

import contextlib
import inspect

import torch


def cache_keyword(model) -> str:
    """The keyword ``model``'s forward takes its KV cache by: ``cache`` in recent transformers
    (which deprecates ``past_key_values``), ``past_key_values`` before."""
    forward = type(model).forward if isinstance(model, torch.nn.Module) else model
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def greedy_decode(model, input_ids: torch.LongTensor, max_new_tokens: int, *, eos_token_id: int | None = None,
                  max_cache_len: int | None = None, skip_guards: bool = False) -> torch.LongTensor:
    """``input_ids`` followed by up to ``max_new_tokens`` greedy tokens, (batch, prompt + new).

    One prefill call, then one call per token with a ``StaticCache`` of ``max_cache_len`` slots
    (default: prompt + new tokens). With ``eos_token_id``, a sequence that produced it is padded with
    it, and decoding stops once every sequence has. Compile ``model.forward`` (e.g. with the dejavu
    backend) before calling; the loop itself runs under ``torch.no_grad()``.

    ``skip_guards=True`` runs the decode steps after the second without Dynamo's guard checks
    (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``; what the guards cost on a Hugging
    Face model: ``benchmarks/profile_decode.py``). Every decode step passes inputs of the same types and shapes,
    so the graph the second step ran is the one the guards would pick, provided that step compiled
    nothing new (it is checked: otherwise the guards stay on). Unsafe in torch's sense: a model whose
    forward specializes on a value that changes from step to step would silently reuse a stale graph.
    Dynamo keeps the guards of inputs that are not ``nn.Parameter`` s under that stance, so it saves
    nothing for the int8 weights of ``quantize_weights``, which are buffers
    (``benchmarks/step_overhead.py``). Compiling with ``torch.compile``'s
    ``options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}`` drops the
    guards on the model's modules for every call, under any loop (``benchmarks/module_guards.py``;
    what that gives up, weight dtype checks included: ``docs/usage.md``, "The decode path").
    """
    from transformers import StaticCache

    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (batch, prompt_length) with a prompt, got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    batch, prompt = input_ids.shape
    length = prompt + max_new_tokens
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len or length)
    out = torch.empty(batch, length, dtype=input_ids.dtype, device=input_ids.device)
    out[:, :prompt] = input_ids
    finished = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    position = torch.arange(prompt, device=input_ids.device)
    tokens = input_ids
    keyword = cache_keyword(model)
    graphs_before_last_step = None
    with torch.no_grad(), contextlib.ExitStack() as unguarded:
        for step in range(max_new_tokens):
            # decode step 2 compiled nothing
            if skip_guards and step == 3 and _compiled_graphs() == graphs_before_last_step:
                unguarded.enter_context(torch.compiler.set_stance("default", skip_guard_eval_unsafe=True))
            graphs_before_last_step = _compiled_graphs()
            logits = model(input_ids=tokens, **{keyword: cache}, use_cache=True, cache_position=position).logits
            tokens = logits[:, -1].argmax(-1, keepdim=True)
            if eos_token_id is not None:
                tokens = tokens.masked_fill(finished[:, None], eos_token_id)
                finished |= tokens[:, 0] == eos_token_id
            out[:, prompt + step] = tokens[:, 0]
            if eos_token_id is not None and bool(finished.all()):
                return out[:, :prompt + step + 1]
            position = position[-1:] + 1
    return out


def _compiled_graphs() -> int:
    """How many graphs Dynamo has compiled in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
