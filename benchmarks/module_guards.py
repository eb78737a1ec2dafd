"""What Dynamo's guards on the model's modules cost a SmolLM2 decode step under ``generate()``, and
which of them: the tensor guards on its parameters and buffers, or the rest (module types, their
dicts and hooks, attribute values).

    python benchmarks/module_guards.py --weights int8 --repeats 15 --out benchmarks/results/module-guards-int8-avx2.json
    python benchmarks/module_guards.py --out benchmarks/results/module-guards-avx2.json   # fp32 weights
    python benchmarks/module_guards.py --weights int8 --repeats 15 \\
        --out benchmarks/results/module-guards-int8-avx512.json   # on an AVX-512 CPU

One model, four compiled forwards (dejavu exact: no plan, every projection through the backend's
GEMV), each with its own Dynamo cache (``isolate_recompiles=True``) and guard filter
(``torch.compile(..., options={"guard_filter_fn": ...})``):

- guards kept: Dynamo's default;
- weight tensor guards skipped: the TENSOR_MATCH guards of tensors read from a module's
  ``_parameters`` or ``_buffers`` are dropped, every other guard is kept;
- module structure guards skipped: the guards on modules that check structure (types, hook dicts,
  attribute presence) are dropped, those that compare values (the weights' tensor checks,
  ``training`` flags, config constants) kept: the filter that would keep a model changed after
  compiling (cast, moved, put in training mode) recompiling, if it were cheap;
- module guards skipped: ``torch.compiler.skip_guard_on_all_nn_modules_unsafe``, every guard whose
  source is a module attribute is dropped. Unsafe in torch's sense: a module attribute changed after
  compiling (``model.train()``, ``.to()`` another dtype, a config flag, a hook, a new submodule) no
  longer recompiles, and another model of the same class compiled in the same process would run
  these graphs (hence ``isolate_recompiles=True``); the weights are still read from the modules on
  every call, so values edited in place or parameters replaced by ones of the same shape and dtype
  are used (and the backend's WeightWatch still sees them).

Timed through ``evaluation.bench.measure_decode`` (interleaved rounds, decode tokens/s with the
prefill subtracted, the timed rounds under ``error_on_recompile``, medians); the four must give the
same tokens.
"""
from __future__ import annotations

import argparse
import re

import torch

WEIGHT_SOURCE = re.compile(r"\._(parameters|buffers)\['[^']*'\]$")


class CountingFilter:
    """A guard filter that keeps what ``keep(entries)`` says and records how many guards each compiled
    frame had and dropped."""

    def __init__(self, keep):
        self.keep = keep
        self.frames: list[dict] = []

    def __call__(self, entries):
        kept = [bool(k) for k in self.keep(entries)]
        self.frames.append({"guards": len(kept), "dropped": len(kept) - sum(kept)})
        return kept


def keep_unless_weight_tensor(entries) -> list[bool]:
    return [not (entry.guard_type == "TENSOR_MATCH" and WEIGHT_SOURCE.search(entry.name)
                 and entry.orig_guard.source.is_unspecialized_nn_module()) for entry in entries]


# guards on a module attribute that compare a value: tensors' dtype, shape and device, flags and numbers
VALUE_GUARDS = frozenset({"TENSOR_MATCH", "CONSTANT_MATCH", "EQUALS_MATCH"})


def keep_unless_module_structure(entries) -> list[bool]:
    return [not entry.orig_guard.source.is_unspecialized_nn_module() or entry.guard_type in VALUE_GUARDS
            for entry in entries]


keep_unless_module = torch.compiler.skip_guard_on_all_nn_modules_unsafe


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default="float", choices=["float", "int8"],
                    help="int8: dejavu_compile.quantize_weights(model, 'int8')")
    ap.add_argument("--new-tokens", type=int, default=33)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None, help="JSON results file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import inspect

    if "isolate_recompiles" not in inspect.signature(torch.compile).parameters:
        raise SystemExit(f"torch {torch.__version__}: torch.compile has no isolate_recompiles, which keeps the "
                         "four compiled forwards' graphs apart")
    from dejavu_compile.cli import DEMO_PROMPT
    from dejavu_compile.evaluation.bench import (
        Variant,
        compiled_forward,
        cpu_machine_description,
        measure_decode,
        prepared_smollm2,
        write_result,
    )

    model, tok = prepared_smollm2(args.weights)
    machine = cpu_machine_description()
    print(f"machine: {machine}")
    filters = {"guards kept": None, "weight tensor guards skipped": CountingFilter(keep_unless_weight_tensor),
               "module structure guards skipped": CountingFilter(keep_unless_module_structure),
               "module guards skipped": CountingFilter(keep_unless_module)}
    variants = [Variant(name, compiled_forward("dejavu", isolate_recompiles=True,
                                               options={} if filt is None else {"guard_filter_fn": filt}))
                for name, filt in filters.items()]
    ids = tok(DEMO_PROMPT, return_tensors="pt").input_ids
    speed = measure_decode(model, ids, variants, new_tokens=args.new_tokens, repeats=args.repeats)
    for v in variants[1:]:
        if not torch.equal(v.outputs, variants[0].outputs):
            raise RuntimeError(f"{v.name!r} decoded other tokens than {variants[0].name!r}")

    base = speed["guards kept"]["tokens_per_s"]
    print(f"\nSmolLM2-135M, {args.weights} weights, dejavu exact, generate(), {args.threads} threads, "
          f"{args.new_tokens} new tokens, {args.repeats} rounds")
    print(f"{'':<32}{'tokens/s':>10}{'ms/token':>10}{'vs kept':>9}{'guards dropped per graph':>26}")
    for name, filt in filters.items():
        tps = speed[name]["tokens_per_s"]
        dropped = "" if filt is None else " / ".join(str(f["dropped"]) for f in filt.frames)
        print(f"{name:<32}{tps:10.1f}{1e3 / tps:10.2f}{tps / base:8.2f}x{dropped:>26}")
    if args.out:
        record = dict(machine=machine, threads=args.threads, weights=args.weights, variant="dejavu exact",
                      loop="generate", new_tokens=args.new_tokens, repeats=args.repeats,
                      tokens_per_s={name: r["tokens_per_s"] for name, r in speed.items()},
                      ms_per_token={name: 1e3 / r["tokens_per_s"] for name, r in speed.items()},
                      runs={name: r["runs"] for name, r in speed.items()},
                      guards_per_graph={name: f.frames for name, f in filters.items() if f is not None})
        write_result(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
