"""Where a SmolLM2 decode step goes on CPU: torch.profiler over Inductor dense and dejavu decode.

    python benchmarks/profile_decode.py                          # int8 predictor, 70% MLP density
    python benchmarks/profile_decode.py --layout                 # does prepare_model slow dense?

The profile runs 32 decode steps (static cache, batch 1) per variant after warm-up and prints the
operators by self time; Inductor's generated loops are named (``cpp.enable_kernel_profile``).
``--layout`` instead decodes with Inductor dense on two copies of the model, as loaded and after
``prepare_model`` (down/o projections stored transposed), interleaved, to check that the layout the
sparse kernels want does not slow the dense baseline the benchmarks compare against.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch


def _decode_seconds(model, ids, tokens: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                       cache_implementation="static")
    return time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--predictor", choices=("int8", "lowrank"), default="int8")
    ap.add_argument("--density", type=float, default=0.7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layout", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cpu-lowering", nargs="+", default=["auto"], choices=["auto", "native", "op", "decomposed"],
                    help="sparse-MLP lowerings to profile (auto = decomposed; op: the custom op, its C kernel)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config

    from dejavu_compile.evaluation.bench import compiled_forward, machine_description
    from dejavu_compile.calibration.calibrate import calibrate
    from dejavu_compile.cli import DEMO_PROMPT
    from dejavu_compile.assets.models import load_smollm2
    from dejavu_compile.compiler.prepare import prepare_model

    inductor_config.cpp.enable_kernel_profile = True
    model, tok = load_smollm2()
    ids = tok(DEMO_PROMPT, return_tensors="pt").input_ids
    print(f"machine: {machine_description()}")
    if args.layout:
        prepared = copy.deepcopy(model)
        prepare_model(prepared)
        models = {"as loaded": model, "prepare_model": prepared}
        for m in models.values():
            m.forward = compiled_forward("inductor")(m.forward)
            for tokens in (33, 1):
                _decode_seconds(m, ids, tokens)
        rates = {name: [] for name in models}
        for _ in range(args.repeats):
            for name, m in models.items():
                rates[name].append(32 / (_decode_seconds(m, ids, 33) - _decode_seconds(m, ids, 1)))
        for name, r in rates.items():
            print(f"Inductor dense, weights {name:14s}: median {sorted(r)[len(r) // 2]:.2f} tokens/s  "
                  f"({', '.join(f'{x:.1f}' for x in r)})")
        return 0

    plan = calibrate(model, tok, predictor=args.predictor, mlp_density=args.density, max_tokens=2048, progress=False)
    prepare_model(model)
    original = model.forward
    variants = {"Inductor dense": compiled_forward("inductor")}
    for lowering in args.cpu_lowering:
        name = f"dejavu {args.predictor} {plan.mlp_density:.2f}" + ("" if lowering == "auto" else f" [{lowering}]")
        variants[name] = compiled_forward("dejavu", options={"plan": plan, "cpu_lowering": lowering})
    for name, wrap in variants.items():
        model.forward = wrap(original)
        for tokens in (33, 1, 33, 1):  # compiles every graph these lengths need (the static cache size is one)
            _decode_seconds(model, ids, tokens)
        step = (_decode_seconds(model, ids, 33) - _decode_seconds(model, ids, 1)) / 32
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _decode_seconds(model, ids, 33)
        print(f"\n{name}: {1e3 * step:.1f} ms per decode step unprofiled; profile of 32 steps (+ prefill):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=70))
        model.forward = original
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
