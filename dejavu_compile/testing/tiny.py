"""Tiny random-weight decoders for structure and equivalence tests (no downloads)."""
from __future__ import annotations

import torch

# Architectures the foundation is checked on; any HF decoder built from the same parts should match.
ARCHITECTURES = ("opt", "gpt2", "llama", "mistral", "qwen2", "gemma3_text", "gpt_neox", "phi3", "nemotron")


def tiny_config(arch: str, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                intermediate: int = 128, vocab: int = 128, **overrides):
    """A small config of ``arch`` with the special token ids kept inside the vocabulary."""
    from transformers import AutoConfig

    common = dict(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "gpt2":
        kw = dict(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=intermediate, n_positions=256)
    elif arch == "opt":
        kw = dict(hidden_size=hidden, ffn_dim=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                  word_embed_proj_dim=hidden, max_position_embeddings=256)
    elif arch == "gpt_neox":
        kw = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, rotary_pct=0.25, max_position_embeddings=256)
    else:
        kw = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256)
        if arch == "gemma3_text":
            kw.update(head_dim=hidden // heads, sliding_window=64)
    kw.update(common)
    kw.update(overrides)
    return AutoConfig.for_model(arch, **kw)


def tiny_model(arch: str, *, seed: int = 0, attn_implementation: str | None = None, **config_kwargs):
    """``AutoModelForCausalLM.from_config`` on :func:`tiny_config`, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(arch, **config_kwargs)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return AutoModelForCausalLM.from_config(config, **kwargs).eval()
