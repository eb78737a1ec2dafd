"""Decode-speed measurement shared by the demo and ``benchmarks/decode.py``.

Each variant is a way to run ``model.forward`` (eager, Inductor, dejavu with a plan). Variants are
measured interleaved in one process on the same prompt; decode speed excludes the prefill: it is
``(n - 1) / (t(n tokens) - t(1 token))`` with a static cache, medians over repeats.
"""
from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Variant:
    name: str
    wrap: Callable  # original forward -> forward to use (identity for eager)
    forward: Callable | None = None
    times: dict[int, list[float]] = field(default_factory=dict)
    outputs: torch.Tensor | None = None


def _generate(model, ids, new_tokens):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              cache_implementation="static", pad_token_id=model.config.eos_token_id)


def measure_decode(model, ids: torch.Tensor, variants: list[Variant], new_tokens: int = 32,
                   repeats: int = 3, progress: bool = True) -> dict[str, dict]:
    """Tokens/s per variant. The first run of each variant (compilation) is not timed."""
    original = model.forward
    # Every variant compiles the same forward code: without room for all their graphs Dynamo
    # would hit its recompile limit and silently run later variants eagerly.
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 8 * len(variants)))
    for v in variants:
        v.forward = v.wrap(original)
    rounds = [(r, v, n) for r in range(repeats + 1) for v in variants for n in (1, new_tokens)]
    iterator = rounds
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(rounds, desc="decode benchmark", unit="run")
    try:
        for rep, variant, n in iterator:
            model.forward = variant.forward
            start = time.perf_counter()
            out = _generate(model, ids, n)
            elapsed = time.perf_counter() - start
            if rep == 0:  # warm-up: compiles every graph this variant needs
                if n == new_tokens:
                    variant.outputs = out
                continue
            variant.times.setdefault(n, []).append(elapsed)
    finally:
        model.forward = original
    results = {}
    for v in variants:
        decode = [(new_tokens - 1) / (t_n - t_1) for t_1, t_n in zip(v.times[1], v.times[new_tokens])]
        results[v.name] = {"tokens_per_s": statistics.median(decode), "runs": decode,
                           "prefill_s": statistics.median(v.times[1])}
    return results


def cpu_info() -> dict:
    """The CPU from the first processor's block of /proc/cpuinfo: its model name, the name with family
    and model numbers ("cpu"), and the widest vector extension the C kernels use ("isa")."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    name = fields.get("model name") or platform.processor() or platform.machine()
    return {"name": name, "cpu": f"{name} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})",
            "isa": "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other",
            "avx512_vnni": "avx512_vnni" in flags}


def machine_description() -> str:
    device = "CUDA " + torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}, {device}")


def compiled_forward(backend, **compile_kwargs) -> Callable:
    def wrap(forward):
        compiled = torch.compile(forward, backend=backend, **compile_kwargs)

        def step(*args, **kwargs):
            # Each call is a new decode step: CUDA-graph trees may reuse the last step's output
            # memory (generate() keeps no reference to it past the step). No-op without CUDA graphs.
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(*args, **kwargs)

        return step

    return wrap
