"""Tiny random-weight decoders for structure and equivalence tests (no downloads)."""
from __future__ import annotations

import torch

# Architectures the foundation is checked on; any HF decoder built from the same parts should match.
ARCHITECTURES = ("opt", "gpt2", "llama", "mistral", "qwen2", "gemma3_text", "gpt_neox", "phi3", "nemotron")

# Every Hugging Face decoder family known to match, calibrate and decode (tests/test_families.py).
GATED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "vaultgemma", "phi3",
                  "olmo", "olmo2", "granite", "cohere", "cohere2", "glm", "glm4", "helium", "smollm3", "exaone4",
                  "stablelm", "internlm3", "seed_oss", "ernie4_5")
PLAIN_FAMILIES = ("opt", "gpt2", "gpt_neox", "nemotron", "falcon", "starcoder2", "phi", "bloom", "mpt",
                  "gpt_bigcode", "gptj", "codegen", "gpt_neo", "biogpt", "persimmon", "arcee", "nanochat")
FAMILIES = GATED_FAMILIES + PLAIN_FAMILIES


def _family_keys(arch: str, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int) -> dict:
    """The config keys each family names its sizes by (HF families disagree)."""
    if arch == "gpt2":
        return dict(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=intermediate, n_positions=256)
    if arch == "openai-gpt":  # MLP width is 4 * hidden
        return dict(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=256)
    if arch == "gpt_bigcode":
        return dict(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=intermediate, n_positions=256,
                    multi_query=True)
    if arch in ("gptj", "codegen"):
        return dict(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=intermediate, n_positions=256,
                    rotary_dim=hidden // heads // 2)
    if arch == "ctrl":
        return dict(n_embd=hidden, n_layer=layers, n_head=heads, dff=intermediate, n_positions=256)
    if arch == "opt":
        return dict(hidden_size=hidden, ffn_dim=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                    word_embed_proj_dim=hidden, max_position_embeddings=256)
    if arch == "gpt_neox":
        return dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                    num_attention_heads=heads, rotary_pct=0.25, max_position_embeddings=256)
    if arch == "bloom":  # MLP width is 4 * hidden in BLOOM
        return dict(hidden_size=hidden, n_layer=layers, n_head=heads)
    if arch == "mpt":
        return dict(d_model=hidden, n_layers=layers, n_heads=heads, expansion_ratio=intermediate // hidden,
                    max_seq_len=256)
    if arch == "falcon":
        return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                    ffn_hidden_size=intermediate, multi_query=True, new_decoder_architecture=False,
                    parallel_attn=True)
    if arch == "gpt_neo":
        return dict(hidden_size=hidden, num_layers=layers, num_heads=heads, intermediate_size=intermediate,
                    attention_types=[[["global", "local"], layers // 2 or 1]], max_position_embeddings=256)
    if arch == "biogpt":
        return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                    intermediate_size=intermediate, max_position_embeddings=256)
    kw = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256)
    if arch in ("gemma", "gemma2", "gemma3_text", "vaultgemma", "helium"):  # their default head_dim is 256
        kw.update(head_dim=hidden // heads)
    if arch == "gemma3_text":
        kw.update(sliding_window=64)
    return kw


def tiny_config(arch: str, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                intermediate: int = 128, vocab: int = 128, **overrides):
    """A small config of ``arch`` with the special token ids kept inside the vocabulary."""
    from transformers import AutoConfig

    kw = _family_keys(arch, layers, hidden, heads, kv_heads, intermediate)
    kw.update(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(overrides)
    return AutoConfig.for_model(arch, **kw)


def tiny_model(arch: str, *, seed: int = 0, attn_implementation: str | None = None, **config_kwargs):
    """``AutoModelForCausalLM.from_config`` on :func:`tiny_config`, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(arch, **config_kwargs)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return AutoModelForCausalLM.from_config(config, **kwargs).eval()
