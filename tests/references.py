"""Whole-model masked references the backend's sparse decode is compared with: eager logits with
forward hooks that keep only the neurons (or heads) a plan's predictors pick, the others zeroed."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from dejavu_compile import activations


def logits_with_hooks(model, ids, handles):
    """Logits of one uncached forward, then the hooks are removed."""
    try:
        with torch.no_grad():
            return model(ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()


def masked_reference_llama(model, plan, ids, *, float64=False):
    """Eager LLaMA with hooks: each MLP keeps the top-k neurons its predictor picks from the
    attention input of the same layer (the lookahead source) or, without lookahead, its own input.
    ``float64``: the rest of the model runs in a float64 copy, the predictors still scoring in fp32
    (as the graph does)."""
    if float64:
        model = copy.deepcopy(model).double()
    handles, sources = [], {}
    for layer, block in enumerate(model.model.layers):
        entry = plan.entries[(layer, "mlp")]

        def keep_source(module, args, output, layer=layer):
            sources[layer] = output

        def mask_hidden(module, args, layer=layer, entry=entry):
            (hidden,) = args
            flat = hidden.reshape(-1, hidden.shape[-1])
            source = sources[layer].reshape(-1, sources[layer].shape[-1])
            idx = entry.scores(source.float() if float64 else source).topk(entry.k, dim=-1).indices
            mask = torch.zeros_like(flat).scatter(-1, idx, 1.0)
            return ((flat * mask).view_as(hidden),)

        source = block.input_layernorm if entry.lookahead else block.post_attention_layernorm
        handles.append(source.register_forward_hook(keep_source))
        handles.append(block.mlp.down_proj.register_forward_pre_hook(mask_hidden))
    return logits_with_hooks(model, ids, handles)


def masked_heads_reference_llama(model, plan, ids):
    """Eager LLaMA with hooks: each attention block's output projection sees only the heads its
    predictor picks, from the previous layer's MLP input (lookahead) or its own input (layer 0)."""
    handles, inputs = [], {}
    layers = model.model.layers
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    for layer, block in enumerate(layers):
        def keep(name):
            def hook(module, args, output):
                inputs[name] = output.reshape(-1, output.shape[-1])
            return hook

        handles.append(block.input_layernorm.register_forward_hook(keep(("attention", layer))))
        handles.append(block.post_attention_layernorm.register_forward_hook(keep(("mlp", layer))))
        entry = plan.entries[(layer, "attention")]

        def mask_heads(module, args, layer=layer, entry=entry):
            (heads,) = args  # (B, T, H*D)
            source = inputs[("mlp", layer - 1)] if entry.lookahead else inputs[("attention", layer)]
            idx = entry.scores(source).topk(entry.k, dim=-1).indices
            mask = torch.zeros(idx.shape[0], entry.total, device=idx.device).scatter(-1, idx, 1.0)
            mask = mask.repeat_interleave(head_dim, -1)
            return (heads * mask.view_as(heads),)

        handles.append(block.self_attn.o_proj.register_forward_pre_hook(mask_heads))
    return logits_with_hooks(model, ids, handles)


def int8_predictor_values(entry, x64, act=F.silu):
    """What a values="predictor" entry gives its neurons: act(g~ x) * (u~ x) of the dequantized int8
    gate/up rows, in float64 (``x64`` float64)."""
    assert entry.predictor == "glu_int8"
    rows = entry.tensors["rows"].double() * entry.tensors["scales"].double()[:, None]
    return act(x64 @ rows[:entry.total].T) * (x64 @ rows[entry.total:].T)


def predictor_values_reference(model, plan, ids, down_rows=None):
    """Logits of eager with each MLP replaced by what a values="predictor" entry means: the int8
    predictor's act(g~) * u~ (float64, from the dequantized rows) on the top k by magnitude, times
    the down projection, rounded to bf16 first where the plan's down_rows (or `down_rows`) says so."""
    down_rows = down_rows or plan.down_rows
    handles = []
    for layer, block in enumerate(model.model.layers):
        entry = plan.entries[(layer, "mlp")]

        def replace_mlp(module, args, output, entry=entry):
            (x,) = args
            h = int8_predictor_values(entry, x.reshape(-1, x.shape[-1]).double())
            idx = h.abs().topk(entry.k, dim=-1).indices
            kept = torch.zeros_like(h).scatter(-1, idx, h.gather(-1, idx))
            down = module.down_proj.weight
            if down_rows == "bfloat16":
                down = down.bfloat16()
            return (kept @ down.double().T).to(x.dtype).view_as(output)

        handles.append(block.mlp.register_forward_hook(replace_mlp))
    return logits_with_hooks(model, ids, handles)


def nemotron_masked_reference(model, plan, ids):
    """Eager logits where each (plain, squared-ReLU) MLP is replaced by sum over kept neurons j of
    relu2(up_j . x) down_j, computed in float64 from the activation table's reference, the kept set
    chosen by the plan's predictor from the lookahead source (the layer's attention input) or the
    MLP's own input."""
    handles, sources = [], {}
    relu2 = activations.get("relu2").reference
    for layer, block in enumerate(model.model.layers):
        entry = plan.entry(layer, "mlp")

        def keep_source(module, args, output, layer=layer):
            sources[layer] = output

        def sparse_mlp(module, args, output, layer=layer, entry=entry):
            (x,) = args
            flat = x.reshape(-1, x.shape[-1])
            source = sources[layer].reshape(-1, sources[layer].shape[-1])
            idx = entry.select(source)
            up = module.up_proj.weight.double()
            down = module.down_proj.weight.double()
            hidden = relu2(flat.double() @ up.t())
            mask = torch.zeros_like(hidden).scatter(-1, idx, 1.0)
            return ((hidden * mask) @ down.t()).to(output.dtype).view_as(output)

        source = block.input_layernorm if entry.lookahead else block.post_attention_layernorm
        handles.append(source.register_forward_hook(keep_source))
        handles.append(block.mlp.register_forward_hook(sparse_mlp))
    return logits_with_hooks(model, ids, handles)
