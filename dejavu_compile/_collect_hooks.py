"""TEMPORARY stand-in for `dejavu_compile.collect` (the lead's FX-based collector).

Same interface, implemented with forward hooks on a LLaMA-architecture HF model
(`model.model.layers[i].mlp.{gate_proj,up_proj,down_proj,act_fn}`, `.self_attn.o_proj`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from dejavu_compile.blocks import AttentionBlock, MLPBlock, WeightRef


@dataclass
class LayerSamples:
    layer: int
    mlp_input: torch.Tensor  # (N, d) input of the MLP block (post-norm)
    mlp_importance: torch.Tensor  # (N, F) |act(gate(x)) * up(x)|
    attn_input: torch.Tensor  # (N, d) input of the attention block (post-norm)
    attn_importance: torch.Tensor  # (N, H) L2 norm of each query head's contribution to o_proj's output


def llama_layers(model) -> list:
    """The decoder layers of a LLaMA-style HF model (raises a clear error otherwise)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(layers[0], "mlp") or not hasattr(layers[0].mlp, "down_proj"):
        raise ValueError("the hook-based collector supports LLaMA-architecture models only (model.model.layers[i].mlp.down_proj)")
    return list(layers)


def head_contributions(o_proj_input: torch.Tensor, o_weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(N, H*hd) input of o_proj, (d, H*hd) weight -> (N, H) L2 norm of each head's output contribution."""
    n = o_proj_input.shape[0]
    hd = o_proj_input.shape[1] // num_heads
    z = o_proj_input.reshape(n, num_heads, hd).float()
    w = o_weight.float().reshape(o_weight.shape[0], num_heads, hd)
    return torch.einsum("nhe,dhe->nhd", z, w).norm(dim=-1)


def _make(cls, **kw):
    """Build a block record, filling fields this stand-in doesn't know (blocks.py evolves) with
    neutral values so the records stay constructible."""
    import dataclasses

    for f in dataclasses.fields(cls):
        if f.name in kw or f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            continue
        t = str(f.type)
        kw[f.name] = "" if "str" in t else False if "bool" in t else 0 if "int" in t else None
    return cls(**{k: v for k, v in kw.items() if k in {f.name for f in dataclasses.fields(cls)}})


def block_records(model) -> list:
    """MLPBlock / AttentionBlock records for a LLaMA model (no FX nodes)."""
    cfg = model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", heads) or heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    recs: list = []
    for i, _ in enumerate(llama_layers(model)):
        p = f"model.layers.{i}"
        recs.append(
            _make(
                AttentionBlock, layer=i, rule="llama-hooks",
                q=WeightRef(f"{p}.self_attn.q_proj.weight"), k=WeightRef(f"{p}.self_attn.k_proj.weight"),
                v=WeightRef(f"{p}.self_attn.v_proj.weight"), o=WeightRef(f"{p}.self_attn.o_proj.weight"),
                num_heads=heads, num_kv_heads=kv, head_dim=hd, rotary="full", cache="none", attention="sdpa",
                kv_sharing="mha" if kv == heads else ("mqa" if kv == 1 else "gqa"),
                decode=False, tokens=0, module=f"{p}.self_attn",
            )
        )
        recs.append(
            _make(
                MLPBlock, layer=i, rule="llama-hooks", gated=True, activation=str(getattr(cfg, "hidden_act", "silu")),
                up=WeightRef(f"{p}.mlp.up_proj.weight"), down=WeightRef(f"{p}.mlp.down_proj.weight"),
                gate=WeightRef(f"{p}.mlp.gate_proj.weight"), hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size, decode=False, tokens=0, module=f"{p}.mlp",
            )
        )
    return recs


def _first_tensor(args, kwargs, name="hidden_states"):
    if args:
        return args[0]
    return kwargs[name]


@torch.no_grad()
def collect(
    model, token_batches: Iterable[torch.LongTensor], max_tokens: int = 8192, progress: bool = True, seed: int = 0
) -> tuple[dict[int, LayerSamples], list]:
    """Run (1, T) batches through `model`; per layer, samples of at most `max_tokens` tokens."""
    from tqdm.auto import tqdm

    batches = list(token_batches)
    total = sum(b.numel() for b in batches)
    gen = torch.Generator().manual_seed(seed)
    # Uniform subsample of all tokens, decided up front so each batch keeps its share.
    keep_all = torch.randperm(total, generator=gen)[: min(max_tokens, total)].sort().values
    layers = llama_layers(model)
    num_heads = model.config.num_attention_heads
    store: dict[int, dict[str, list]] = {i: {k: [] for k in ("mi", "mh", "ai", "ah")} for i in range(len(layers))}
    state = {"keep": None}

    def take(t):  # (1, T, X) -> (n_keep, X) float32
        return t.reshape(-1, t.shape[-1])[state["keep"]].float().cpu()

    hooks = []
    for i, layer in enumerate(layers):
        s = store[i]
        hooks.append(layer.self_attn.register_forward_pre_hook(
            lambda m, a, k, s=s: s["ai"].append(take(_first_tensor(a, k))), with_kwargs=True))
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(
            lambda m, a, s=s: s["ah"].append(head_contributions(take(a[0]), m.weight, num_heads))))
        hooks.append(layer.mlp.register_forward_pre_hook(
            lambda m, a, k, s=s: s["mi"].append(take(_first_tensor(a, k, "x"))), with_kwargs=True))
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(
            lambda m, a, s=s: s["mh"].append(take(a[0]).abs())))
    offset = 0
    was_training = model.training
    model.eval()
    try:
        for b in tqdm(batches, desc="collect", disable=not progress, unit="batch"):
            n = b.numel()
            lo = torch.searchsorted(keep_all, offset)
            hi = torch.searchsorted(keep_all, offset + n)
            state["keep"] = keep_all[lo:hi] - offset
            offset += n
            if hi > lo:
                # The decoder stack only: the LM head's logits are not needed here (~20% of the FLOPs).
                base = getattr(model, "model", model)
                base(input_ids=b.to(next(model.parameters()).device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    samples = {
        i: LayerSamples(
            layer=i, mlp_input=torch.cat(s["mi"]), mlp_importance=torch.cat(s["mh"]),
            attn_input=torch.cat(s["ai"]), attn_importance=torch.cat(s["ah"]),
        )
        for i, s in store.items()
    }
    return samples, block_records(model)
