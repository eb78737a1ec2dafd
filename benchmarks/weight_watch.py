"""What the backend's checks of the weights cost a SmolLM2-135M decode step on the CPU.

    python benchmarks/weight_watch.py --repeats 15     # writes benchmarks/results/weight-watch.json
    python benchmarks/weight_watch.py --repeats 15 --check-off-first \\
        --out benchmarks/results/weight-watch-off-first.json

A graph the backend rewrote holds tensors derived from the weights (here the training-free plan's
int8 gate/up copies, ``mlp_density=0.6``), and on every call compares each parameter input's
version counter and storage with the ones it was derived from (``WeightWatch``); every graph also
compares the dtype, shape and device of a sample of the model's tensors with the ones it was
compiled for (``StoredTensorCheck``; both in ``compiler/weight_watch.py``). One compiled forward is
measured with the checks on and off (``weight_watch.ENABLED``), as two variants of
``evaluation.bench.measure_decode``: fp32, batch 1, greedy, ``generate()`` with a static cache, the
variants interleaved in each round (``--check-off-first`` swaps their order), medians. Each check
alone is also timed directly, on the decode graph's own arguments, in a loop that keeps them in
cache.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import torch

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _checked_calls(compiled, model, ids, *check_classes) -> list[list]:
    """For each of ``check_classes``, [(check, args)] of every graph of one decode step that runs it."""
    seen = [{} for _ in check_classes]
    originals = [cls.check for cls in check_classes]

    def recorder(calls, original):
        def record(self, args):
            calls[id(self)] = (self, list(args))
            return original(self, args)
        return record

    for cls, calls, original in zip(check_classes, seen, originals):
        cls.check = recorder(calls, original)
    try:
        model.forward = compiled
        with torch.no_grad():
            model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, cache_implementation="static",
                           pad_token_id=model.config.eos_token_id)
    finally:
        for cls, original in zip(check_classes, originals):
            cls.check = original
    return [list(calls.values()) for calls in seen]


def _time_checks(calls, repeats: int) -> float:
    """Median microseconds of one decode step's worth of ``calls``, weights unchanged."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for check, call_args in calls:
            check.check(call_args)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--check-calls", type=int, default=2000)
    ap.add_argument("--check-off-first", action="store_true", help="time the check-off variant first in each round")
    ap.add_argument("--out", default=str(RESULTS / "weight-watch.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from dejavu_compile.assets.models import load_smollm2
    from dejavu_compile.cli import machine
    from dejavu_compile.compiler import weight_watch
    from dejavu_compile.compiler.prepare import prepare_model
    from dejavu_compile.evaluation.bench import Variant, measure_decode, write_result

    model, tok = load_smollm2()
    prepare_model(model)
    ids = tok("The history of the city begins", return_tensors="pt").input_ids
    original = model.forward
    compiled = torch.compile(original, backend="dejavu", options={"mlp_density": 0.6})

    def with_check(enabled):
        def forward(*a, **kw):
            weight_watch.ENABLED = enabled
            return compiled(*a, **kw)
        return lambda _forward: forward

    # both call the same compiled forward, which the first compiles
    variants = [Variant("check on", with_check(True)), Variant("check off", with_check(False))]
    if args.check_off_first:
        variants.reverse()
    variants[1].compiled = False
    try:
        speed = measure_decode(model, ids, variants, new_tokens=args.new_tokens, repeats=args.repeats)
        watched, sampled = _checked_calls(compiled, model, ids, weight_watch.WeightWatch,
                                          weight_watch.StoredTensorCheck)
    finally:
        weight_watch.ENABLED = True
        model.forward = original
    if not watched:
        raise SystemExit("no compiled graph holds a weight watch: the plan did not make the decode graph sparse")
    if not torch.equal(variants[0].outputs, variants[1].outputs):
        raise SystemExit("the two variants generated different tokens")

    # each check alone, as a decode step runs it: every graph of the step, weights unchanged
    check_median = _time_checks(watched, args.check_calls)
    stored_median = _time_checks(sampled, args.check_calls)
    on, off = speed["check on"]["tokens_per_s"], speed["check off"]["tokens_per_s"]
    step_ms = 1e3 / off
    result = {
        "machine": machine(),
        "model": "SmolLM2-135M-Instruct fp32, prepare_model, options={'mlp_density': 0.6}",
        "new_tokens": args.new_tokens, "repeats": args.repeats,
        "order": [v.name for v in variants],
        "tokens_per_s": {"check on": on, "check off": off},
        "runs": {name: speed[name]["runs"] for name in speed},
        "step_ms_check_off": step_ms,
        "ratio_on_over_off": on / off,
        "watched_graphs_per_step": len(watched),
        "watched_parameters_per_step": sum(len(w.positions) for w, _ in watched),
        "check_us_per_step_median": check_median,
        "check_share_of_step": check_median / (step_ms * 1e3),
        "stored_tensor_check_graphs_per_step": len(sampled),
        "stored_tensors_checked_per_step": sum(len(c.positions) for c, _ in sampled),
        "stored_tensor_check_us_per_step_median": stored_median,
    }
    write_result(args.out, result)
    m = result["machine"]
    print(f"machine: {m['cpu']}, {m['threads']} threads, torch {m['torch']}")
    print(f"decode: check on {on:.1f} tokens/s, check off {off:.1f} tokens/s (on/off {on / off:.3f}); "
          f"step {step_ms:.2f} ms")
    print(f"the check alone: {check_median:.1f} us per step over {result['watched_parameters_per_step']} "
          f"parameters in {len(watched)} graph(s), {100 * result['check_share_of_step']:.2f}% of a step")
    print(f"the tensors' dtype and shape check alone: {stored_median:.1f} us per step over "
          f"{result['stored_tensors_checked_per_step']} tensors in {len(sampled)} graph(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
