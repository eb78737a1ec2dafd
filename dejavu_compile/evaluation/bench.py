"""The one decode-timing harness: the demo, ``dejavu-compile bench`` and every decode benchmark
(``benchmarks/decode.py``, ``peers.py``, ``decode_ab.py``, ``profile_decode.py``) time through
:func:`measure_decode`.

Each variant is a way to run the model: ``model.forward`` wrapped (eager, Inductor, dejavu with a
plan) and driven by ``generate()`` or by ``greedy_decode``, or an outside runtime's own call (a
peer such as llama.cpp). Variants are measured interleaved in one process on the same prompt, so
the machine's drift hits them alike: one warm-up round that compiles every graph (untimed, its
tokens kept), then ``repeats`` timed rounds. Decode speed excludes the prefill: it is
``(n - 1) / (t(n tokens) - t(1 token))``, medians over rounds. A compiled variant must compile its
graphs in the warm-up, and the timed rounds run under Dynamo's ``error_on_recompile``, so a variant
that fell back to eager (past the recompile limit) or recompiles fails the run instead of being
timed as something it is not.
"""
from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

LOOPS = ("generate", "greedy_decode", "greedy_decode_unguarded")


@dataclass
class Variant:
    """One way to decode. ``wrap`` turns the model's forward into the one to use (variants given the
    same ``wrap`` object share one compiled forward); ``loop`` drives it (``generate()`` with a
    static cache, ``greedy_decode``, or ``greedy_decode(skip_guards=True)``); ``max_cache_len``
    gives the greedy loops' static cache that many slots (a cache allocated once for longer
    sequences; default: prompt + new tokens). ``run`` instead decodes with an outside runtime:
    ``run(n)`` returns its n new tokens (ids or text). ``compiled`` (default: a ``wrap`` is given)
    says whether the warm-up must compile graphs. ``model`` is the model this variant decodes
    (default: the one given to ``measure_decode``), for the same weights in another format; its
    compiled forward must compile graphs of its own (a model of the same class, dtype and shapes
    reuses another's graphs, compiles nothing, and is refused)."""

    name: str
    wrap: Callable | None = None
    loop: str = "generate"
    run: Callable[[int], object] | None = None
    compiled: bool | None = None
    max_cache_len: int | None = None
    model: torch.nn.Module | None = None
    forward: Callable | None = None
    times: dict[int, list[float]] = field(default_factory=dict)
    outputs: torch.Tensor | None = None  # the warm-up's whole sequence (prompt + new tokens), or run's result

    def __post_init__(self):
        if self.loop not in LOOPS:
            raise ValueError(f"loop must be one of {LOOPS}, got {self.loop!r}")
        if self.compiled is None:
            self.compiled = self.wrap is not None
        if self.max_cache_len is not None and self.loop == "generate":
            raise ValueError("max_cache_len is for the greedy_decode loops (generate() sizes its own cache)")


def _generate(model, ids, new_tokens):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              cache_implementation="static", pad_token_id=model.config.eos_token_id)


def _decode(model, ids, variant: Variant, n: int):
    if variant.run is not None:
        return variant.run(n)
    if variant.loop == "generate":
        return _generate(model, ids, n)
    from dejavu_compile.evaluation.decode import greedy_decode

    return greedy_decode(model, ids, n, max_cache_len=variant.max_cache_len,
                         skip_guards=variant.loop == "greedy_decode_unguarded")


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def raise_recompile_limits(variants: int) -> None:
    """Room for every variant's graphs: past Dynamo's limits a variant would silently run eager."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 8 * variants))
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 64 * variants))


def measure_decode(model, ids: torch.Tensor, variants: list[Variant], new_tokens: int = 32,
                   repeats: int = 3, progress: bool = True, pause_s: float = 0.0) -> dict[str, dict]:
    """Tokens/s per variant (see the module docstring). ``pause_s`` before each run lets another
    runtime's spinning threads park. Returns {name: {"tokens_per_s", "runs", "prefill_s"}}; each
    variant's ``outputs`` holds its warm-up tokens."""
    if new_tokens < 2:
        raise ValueError("decode speed needs new_tokens >= 2 (one new token is the prefill alone)")
    models = {id(m): m for m in [model, *(v.model for v in variants if v.model is not None)]}
    originals = {key: m.forward for key, m in models.items()}
    raise_recompile_limits(len(variants))
    forwards, first_of_forward = {}, set()
    for v in variants:
        if v.run is None:
            original = originals[id(v.model if v.model is not None else model)]
            key = (id(original), id(v.wrap) if v.wrap is not None else None)
            if key not in forwards:
                forwards[key] = v.wrap(original) if v.wrap is not None else original
                first_of_forward.add(v.name)
            v.forward = forwards[key]
        v.times = {1: [], new_tokens: []}
    rounds = [(r, v, n) for r in range(repeats + 1) for v in variants for n in (1, new_tokens)]
    iterator = rounds
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(rounds, desc="decode benchmark", unit="run")
    config = torch._dynamo.config
    guard, graphs = config.error_on_recompile, {}
    try:
        for rep, variant, n in iterator:
            if rep == 1 and variant is variants[0] and n == 1:  # the warm-up is over
                _check_compiled(variants, graphs, first_of_forward)
                config.error_on_recompile = True
            target = variant.model if variant.model is not None else model
            if variant.forward is not None:
                target.forward = variant.forward
            if pause_s:
                time.sleep(pause_s)
            before = _compiled_graphs()
            start = time.perf_counter()
            out = _decode(target, ids, variant, n)
            elapsed = time.perf_counter() - start
            target.forward = originals[id(target)]
            if rep == 0:  # warm-up: compiles every graph this variant needs
                graphs[variant.name] = graphs.get(variant.name, 0) + _compiled_graphs() - before
                if n == new_tokens:
                    variant.outputs = out
                continue
            variant.times[n].append(elapsed)
    finally:
        for key, m in models.items():
            m.forward = originals[key]
        config.error_on_recompile = guard
    results = {}
    for v in variants:
        decode = [(new_tokens - 1) / (t_n - t_1) for t_1, t_n in zip(v.times[1], v.times[new_tokens])]
        results[v.name] = {"tokens_per_s": statistics.median(decode), "runs": decode,
                           "prefill_s": statistics.median(v.times[1]),
                           "graphs": graphs.get(v.name, 0)}
    return results


def _check_compiled(variants, graphs, first_of_forward) -> None:
    for v in variants:
        if v.compiled and v.name in first_of_forward and graphs.get(v.name, 0) < 1:
            raise RuntimeError(f"variant {v.name!r} compiled no graph in the warm-up: it would run eager "
                               "(Dynamo's recompile limit, or a forward that is not compiled)")


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


def cpu_machine_description() -> str:
    """machine_description() with the CPU's model and the vector extension the C kernels use."""
    return "{}; {cpu}, {isa}".format(machine_description(), **cpu_info())


def write_result(path, record: dict) -> None:
    """A benchmark's JSON result file, its folder made if missing; says where it went."""
    import json
    import pathlib

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")


def prepared_smollm2(weights: str = "float"):
    """The bundled SmolLM2-135M and its tokenizer as the CPU decode benchmarks run it: eval mode,
    ``prepare_model``, and with ``weights="int8"`` ``quantize_weights`` (its report printed)."""
    from dejavu_compile.assets.models import load_smollm2
    from dejavu_compile.compiler.prepare import prepare_model

    if weights not in ("float", "int8"):
        raise ValueError(f"weights must be 'float' or 'int8', got {weights!r}")
    model, tok = load_smollm2()
    model.eval()
    prepare_model(model)
    if weights == "int8":
        from dejavu_compile.compiler.quantize import quantize_weights

        print(quantize_weights(model, "int8"))
    return model, tok


def compiled_forward(backend, **compile_kwargs) -> Callable:
    def wrap(forward):
        # torch.compile pops keys (guard_filter_fn) out of the options it is given: each compile gets
        # a copy, so one wrap applied to several forwards compiles each with the same options
        kwargs = dict(compile_kwargs)
        if isinstance(kwargs.get("options"), dict):
            kwargs["options"] = dict(kwargs["options"])
        compiled = torch.compile(forward, backend=backend, **kwargs)

        def step(*args, **kwargs):
            # Each call is a new decode step: CUDA-graph trees may reuse the last step's output
            # memory (generate() keeps no reference to it past the step). No-op without CUDA graphs.
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(*args, **kwargs)

        return step

    return wrap
