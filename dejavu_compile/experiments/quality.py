"""Quality of a selection policy: perplexity under a *masked dense simulation*.

The model runs densely; forward hooks multiply the MLP's hidden activation act(gate(x))*up(x)
(the input of down_proj) by the 0/1 mask of the neurons selected for each token, and zero the
non-selected query heads' slices of o_proj's input. Numerically this is what a sparse kernel that
skips those rows/columns computes (up to summation order); it measures quality, not speed.

A selector is any callable
    selector(layer: int, kind: "mlp" | "attention", x: (N, d), lookahead_x: (N, d), *, importance)
        -> LongTensor (N, k) of kept indices, or a (N, total) bool/0-1 mask, or None (keep all)
`importance` is the true per-token |activation| (MLP) or head-contribution norm (attention), which
only the oracle may use. `lookahead_x` is the input of the block that runs before this one
(attention of the same layer for the MLP, the previous layer's MLP for attention; layer 0's
attention gets its own input). A selector with attribute `target == "input"` (TEAL) instead
returns a mask over the MLP block's input channels.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from dejavu_compile.calibration.collect import head_contributions
from dejavu_compile.plan.predictors.baselines import cats_scores, teal_input_mask
from dejavu_compile.plan.predictors.metrics import topk_mask

SIM_LABEL = "masked dense simulation"
Selector = Callable[..., torch.Tensor | None]


def llama_layers(model) -> list:
    """The decoder layers of a LLaMA-style HF model (the hook-based simulation needs its names)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(layers[0], "mlp") or not hasattr(layers[0].mlp, "down_proj"):
        raise ValueError("the hook-based simulation supports LLaMA-architecture models only "
                         "(model.model.layers[i].mlp.down_proj)")
    return list(layers)


def _as_mask(sel: torch.Tensor, total: int, dtype) -> torch.Tensor:
    """Integer tensors are (N, k) kept indices; bool/float tensors are already (N, total) masks."""
    if not sel.dtype.is_floating_point and sel.dtype != torch.bool:
        mask = torch.zeros(sel.shape[0], total, dtype=dtype, device=sel.device)
        return mask.scatter_(1, sel.long(), 1.0)
    return sel.to(dtype)


class MaskedSimulation:
    """Context manager: while active, `model` runs with the selector's masks applied."""

    def __init__(self, model, selector: Selector | None):
        self.model = model
        self.selector = selector
        self.hooks: list = []

    def __enter__(self):
        if self.selector is None:
            return self
        self.acts: dict = {}  # (kind, layer) -> the block input seen this forward
        self.heads = self.model.config.num_attention_heads
        self.input_mode = getattr(self.selector, "target", "neurons") == "input"
        for i, layer in enumerate(llama_layers(self.model)):
            self.hooks += [
                layer.self_attn.register_forward_pre_hook(self._record_attention_input(i), with_kwargs=True),
                layer.mlp.register_forward_pre_hook(self._record_mlp_input(i), with_kwargs=True),
                layer.mlp.down_proj.register_forward_pre_hook(self._mask_neurons(i)),
                layer.self_attn.o_proj.register_forward_pre_hook(self._mask_heads(i)),
            ]
        return self

    def _record_attention_input(self, i):
        def hook(m, a, k):
            self.acts[("attn", i)] = (a[0] if a else k["hidden_states"])
        return hook

    def _record_mlp_input(self, i):
        """Records the MLP's input; with an input-target selector, masks the input's features."""
        def hook(m, a, k):
            x = a[0] if a else k["x"]
            self.acts[("mlp", i)] = x
            if self.input_mode:
                flat = x.reshape(-1, x.shape[-1])
                mask = self.selector(i, "mlp", flat, self.acts[("attn", i)].reshape(flat.shape), importance=None)
                if mask is not None:
                    x = (flat * mask.to(flat.dtype)).reshape(x.shape)
                    return ((x,) + tuple(a[1:]), k) if a else (a, {**k, "x": x})
        return hook

    def _mask_neurons(self, i):
        """Zeroes the unselected neurons of the down projection's input."""
        def hook(m, a):
            if self.input_mode:
                return None
            h = a[0]
            flat = h.reshape(-1, h.shape[-1])
            x = self.acts[("mlp", i)].reshape(flat.shape[0], -1)
            look = self.acts[("attn", i)].reshape(flat.shape[0], -1)
            s = self.selector(i, "mlp", x, look, importance=flat.abs())
            if s is None:
                return None
            return ((flat * _as_mask(s, flat.shape[-1], flat.dtype)).reshape(h.shape),) + tuple(a[1:])
        return hook

    def _mask_heads(self, i):
        """Zeroes the unselected heads of the output projection's input."""
        def hook(m, a):
            if self.input_mode:
                return None
            z = a[0]
            heads = self.heads
            flat = z.reshape(-1, z.shape[-1])
            x = self.acts[("attn", i)].reshape(flat.shape[0], -1)
            prev = self.acts.get(("mlp", i - 1)) if i > 0 else None
            look = prev.reshape(flat.shape[0], -1) if prev is not None else x
            s = self.selector(i, "attention", x, look, importance=head_contributions(flat, m.weight, heads))
            if s is None:
                return None
            hm = _as_mask(s, heads, flat.dtype)
            hd = flat.shape[-1] // heads
            flat = (flat.reshape(-1, heads, hd) * hm[:, :, None]).reshape(flat.shape)
            return (flat.reshape(z.shape),) + tuple(a[1:])
        return hook

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        self.hooks = []


@torch.no_grad()
def perplexity(model, chunks: Iterable[torch.LongTensor], selector: Selector | None = None,
               progress: bool = False) -> float:
    """Token-level perplexity of (1, T) chunks (each scored on its own, full-sequence forward)."""
    from tqdm.auto import tqdm

    nll, count = 0.0, 0
    model.eval()
    with MaskedSimulation(model, selector):
        for ids in tqdm(list(chunks), desc="ppl", disable=not progress, leave=False):
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            tgt = ids[0, 1:]
            nll += torch.nn.functional.cross_entropy(logits, tgt, reduction="sum").item()
            count += tgt.numel()
    return math.exp(nll / max(1, count))


# --------------------------------------------------------------------------------------------------
# Selectors


def _k(density: float, total: int) -> int:
    return max(1, min(total, int(round(density * total))))


def oracle_selector(mlp_density: float = 0.5, attn_density: float = 1.0) -> Selector:
    """Top-k of the true |act(gate)*up| (and true head-contribution norms) per token."""

    def sel(layer, kind, x, look, *, importance):
        density = mlp_density if kind == "mlp" else attn_density
        if density >= 1.0:
            return None
        return importance.topk(_k(density, importance.shape[-1]), dim=-1).indices

    return sel


def cats_selector(model, mlp_density: float = 0.5) -> Selector:
    """CATS-style: top-k by |act(gate(x))| (needs the full gate GEMV). MLP only."""
    layers = llama_layers(model)

    def sel(layer, kind, x, look, *, importance):
        if kind != "mlp" or mlp_density >= 1.0:
            return None
        mlp = layers[layer].mlp
        s = cats_scores(x, mlp.gate_proj.weight, mlp.act_fn)
        return s.topk(_k(mlp_density, s.shape[-1]), dim=-1).indices

    return sel


class TealSelector:
    """TEAL-style: keep the largest-|x| share of the MLP input channels (input mask, not neurons)."""

    target = "input"

    def __init__(self, density: float):
        self.density = density

    def __call__(self, layer, kind, x, look, *, importance=None):
        if kind != "mlp" or self.density >= 1.0:
            return None
        return teal_input_mask(x, self.density)


def plan_selector(plan, lookahead: bool | None = None) -> Selector:
    """Select with a SparsityPlan's predictors and per-layer k (its entries decide lookahead)."""

    def sel(layer, kind, x, look, *, importance):
        entry = plan.entries.get((layer, kind))
        if entry is None or entry.k >= entry.total:
            return None
        use_look = entry.lookahead if lookahead is None else lookahead
        return entry.select(look if use_look else x)

    return sel


def random_selector(mlp_density: float = 0.5, seed: int = 0) -> Selector:
    g = torch.Generator().manual_seed(seed)

    def sel(layer, kind, x, look, *, importance):
        if kind != "mlp" or mlp_density >= 1.0:
            return None
        return topk_mask(torch.rand(importance.shape, generator=g), _k(mlp_density, importance.shape[-1]))

    return sel


class Harness(NamedTuple):
    """SmolLM2 with collected calibration samples and held-out text, for quality experiments."""

    model: Any
    tokenizer: Any
    samples: dict
    sets: dict  # {"wiki": chunks, "news": chunks}
    dense: dict  # dense perplexity per set
    collect_s: float


def smollm2_harness(calib_tokens: int = 8192, eval_tokens: int = 2048, seq_len: int = 256) -> Harness:
    from dejavu_compile.assets.data import news_texts, tokenize_chunks, wiki_articles
    from dejavu_compile.assets.models import load_smollm2
    from dejavu_compile.calibration.collect import collect

    model, tok = load_smollm2()
    sets = {"wiki": tokenize_chunks(tok, wiki_articles("eval"), seq_len, eval_tokens),
            "news": tokenize_chunks(tok, news_texts(), seq_len, eval_tokens)}
    dense = {name: perplexity(model, chunks) for name, chunks in sets.items()}
    print("dense perplexity: " + ", ".join(f"{k} {v:.3f}" for k, v in dense.items()), flush=True)
    start = time.time()
    samples, _ = collect(model, tokenize_chunks(tok, wiki_articles("calibration"), seq_len, calib_tokens),
                         max_tokens=calib_tokens, progress=True)
    return Harness(model, tok, samples, sets, dense, time.time() - start)


def add_harness_arguments(parser, out: str) -> None:
    """The options every :func:`smollm2_harness` experiment script takes."""
    parser.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens per text set")
    parser.add_argument("--calib-tokens", type=int, default=8192, help="calibration tokens collected")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=out, help="JSON path")


def increases(model, sets: dict, dense: dict, selector: Selector | None) -> dict[str, float]:
    """{"<set>_increase": relative perplexity increase under `selector`} for each held-out set."""
    return {f"{name}_increase": perplexity(model, chunks, selector) / dense[name] - 1 for name, chunks in sets.items()}
