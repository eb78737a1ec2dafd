"""Tiny models with planted contextual sparsity (fast, no real weights), shared by the calibration,
plan and int4-predictor tests: which neurons fire is a low-rank function of the input."""
from __future__ import annotations

import torch

D, FF, H, L, V, PLANT = 64, 256, 4, 2, 97, 6


def tiny_llama(seed: int = 0, planted: bool = True, intermediate: int = FF):
    """A 2-layer LLaMA whose gate/up projections have rank PLANT: which neurons fire is a low-rank
    function of the input (planted contextual sparsity); the large gate scale makes SiLU gate
    most neurons off for each token. ``intermediate``: another MLP width, for a plan of another shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=intermediate, num_hidden_layers=L,
                      num_attention_heads=H, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    if planted:
        with torch.no_grad():
            for layer in model.model.layers:
                for proj, scale in ((layer.mlp.gate_proj, 1.0), (layer.mlp.up_proj, 0.3)):
                    low = torch.randn(intermediate, PLANT) @ torch.randn(PLANT, D) / D**0.5
                    proj.weight.copy_(scale * low)
    return model


def tiny_opt(planted: bool = True, seed: int = 0):
    """A 2-layer OPT (plain ReLU MLP, Deja Vu's own setting) whose fc1 has rank PLANT and a negative
    bias: few neurons fire per token, and which ones is a low-rank function of the input."""
    from dejavu_compile.testing.tiny import tiny_model

    model = tiny_model("opt", seed=seed, hidden=D, intermediate=FF, vocab=V)
    if planted:
        torch.manual_seed(seed)
        with torch.no_grad():
            for layer in model.model.decoder.layers:
                layer.fc1.weight.copy_(torch.randn(FF, PLANT) @ torch.randn(PLANT, D) / D**0.5)
                layer.fc1.bias.fill_(-0.5)
    return model


def batches(n: int = 6, t: int = 64, seed: int = 1):
    """``n`` random (1, t) sequences over the whole vocabulary V."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (1, t), generator=g) for _ in range(n)]
