"""Where a SmolLM2 decode step goes on CPU: Inductor dense, dejavu exact (no plan) and the default plan
(each also with Inductor's Python wrapper instead of the C++ wrapper the backend gives its CPU decode
graphs, and the plan with its projections left to Inductor).

    python benchmarks/profile_decode.py                 # the split below, per variant
    python benchmarks/profile_decode.py --dtype bfloat16 # a bf16 model (Inductor dense, exact, default plan)
    python benchmarks/profile_decode.py --weights int8   # quantize_weights(model, "int8") (dense, exact,
                                                         # the default plan's k; exact also with one call
                                                         # per projection, and with the int8 prefetch off)
    python benchmarks/profile_decode.py --weights int8 --variants "dejavu exact"   # some variants only

For each variant (fp32 unless --dtype/--weights, batch 1, static cache, 2 threads unless --threads;
through ``evaluation.bench.measure_decode``: every variant compiled first, then timed once per
round, rounds interleaved, medians): the decode
step as ``generate()`` runs it, the same compiled forward called in a plain loop over a 128-slot
static cache (generate() allocates prompt + 33 slots, so the two differ by the loop's own cost and
by the attention's cache length; ``benchmarks/peers.py`` measures the loop alone with
``greedy_decode``), and torch.profiler's self time of 16 plain steps grouped into weight
reading (projections and sparse MLP ops), attention, Dynamo's guards, the compiled graph's own code
(Inductor's kernels and its wrapper) and the rest, scaled to the unprofiled step. Under the C++
wrapper the profiler sees the backend's ops but not the aten ops the wrapper calls through
Inductor's C shim (SDPA, mm): their time counts in the compiled graph's own code. The weight-streaming
floor is the bytes a step reads over the machine's streaming rate, measured by the backend's GEMV
over every weight of the model in its format (``cpu_linear``, or ``cpu_q8_linear`` for int8
weights).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

CATEGORIES = {  # profiler event name -> category; the rest is "other"
    "aten::mm": "weights: projections", "aten::addmm": "weights: projections", "aten::linear": "weights: projections",
    "dejavu::cpu_linear": "weights: projections", "dejavu::cpu_screened_linear": "weights: projections",
    "dejavu::cpu_q8_linear": "weights: projections", "dejavu::cpu_linear_cat": "weights: projections",
    "dejavu::cpu_q8_linear_cat": "weights: projections", "dejavu::cpu_q8_glu_mlp": "weights: sparse MLP ops",
    "dejavu::cpu_glu_int8_mlp": "weights: sparse MLP ops",
    "dejavu::cpu_sparse_mlp": "weights: sparse MLP ops", "dejavu::cpu_glu_int8_topk": "weights: sparse MLP ops",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention (SDPA)",
    "dejavu::cpu_decode_attention": "attention (SDPA)",
    "TorchDynamo Cache Lookup": "Dynamo guards",
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--weights", default="float", choices=["float", "int8"],
                    help="int8: dejavu_compile.quantize_weights(model, 'int8') after the cast")
    ap.add_argument("--variants", nargs="+", metavar="NAME",
                    help="only these variants, named as printed (each compiles twice: about a minute on 2 cores)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from dejavu_compile.assets.models import load_smollm2
    from dejavu_compile.cli import BUNDLED, DEMO_PROMPT, _default_plan_dir, load_or_calibrate
    from dejavu_compile.compiler.prepare import prepare_model
    from dejavu_compile.evaluation.bandwidth import bandwidth_bound
    from dejavu_compile.evaluation.bench import Variant, compiled_forward, cpu_machine_description, measure_decode

    model, tok = load_smollm2()
    model.eval()
    ids = tok(DEMO_PROMPT, return_tensors="pt").input_ids
    print(f"machine: {cpu_machine_description()}")
    plan = load_or_calibrate(model, tok, _default_plan_dir(model, BUNDLED))
    model.to(getattr(torch, args.dtype))  # the plan was calibrated on the fp32 weights this rounds
    prepare_model(model)
    if args.weights == "int8":
        from dejavu_compile.compiler.quantize import quantize_weights

        print(quantize_weights(model, "int8"))  # the plan's k per layer reaches the int8 MLPs (cpu_q8_glu_mlp)
    rate = streaming_rate(model)
    dense_bytes = step_weight_bytes(model)
    print(f"format: {args.dtype}, {args.weights} weights; a dense step reads {dense_bytes / 1e6:.0f} MB of weights")
    print(f"streaming rate (the backend's GEMV over every weight): {rate / 1e9:.1f} GB/s")
    print("under the C++ wrapper, SDPA and other aten ops count in the compiled graph's own code (the profiler "
          "does not see Inductor's C shim calls)")
    python_wrapper = {"inductor_config": {"cpp_wrapper": False}}  # Inductor's Python wrapper between kernels
    plan_bytes = dense_bytes / bandwidth_bound(model, plan) if plan is not None else None
    variants = {"Inductor dense": (compiled_forward("inductor"), dense_bytes),
                "dejavu exact, Python wrapper": (compiled_forward("dejavu", options=python_wrapper), dense_bytes),
                "dejavu exact": (compiled_forward("dejavu"), dense_bytes),
                # one GEMV call per projection, not one per input (q, k, v; gate, up)
                "dejavu exact, one call per projection": (
                    compiled_forward("dejavu", options={"dense_lowering": "unfused"}), dense_bytes),
                "dejavu default plan, Python wrapper": (
                    compiled_forward("dejavu", options={"plan": plan, **python_wrapper}), plan_bytes),
                "dejavu default plan": (compiled_forward("dejavu", options={"plan": plan}), plan_bytes),
                # the plan with its dense projections left to Inductor (dense_lowering="aten"); the Python
                # wrapper, under which the profiler sees Inductor's aten calls
                "dejavu default plan, aten projections, Python wrapper": (
                    compiled_forward("dejavu", options={"plan": plan, "dense_lowering": "aten", **python_wrapper}),
                    plan_bytes)}
    if args.dtype != "float32" or args.weights != "float":  # the fp32 profile answers the wrapper questions
        keep = ("Inductor dense", "dejavu exact", "dejavu exact, one call per projection", "dejavu default plan")
        variants = {name: variants[name] for name in keep}
    if args.variants:
        unknown = sorted(set(args.variants) - set(variants))
        if unknown:
            ap.error(f"unknown variant(s) {unknown}; choose from {sorted(variants)}")
        variants = {name: variants[name] for name in args.variants}
    original = model.forward
    forwards = {name: wrap(original) for name, (wrap, _) in variants.items()}
    shared = set()  # variants running another's compiled forward: they compile nothing in the warm-up
    if args.weights == "int8" and "dejavu exact" in variants:  # the same compiled step, int8 prefetch off
        no_prefetch = "dejavu exact, no int8 prefetch"
        variants[no_prefetch] = variants["dejavu exact"]
        forwards[no_prefetch] = _with_tuning(forwards["dejavu exact"], int8_prefetch_rows=0)
        forwards["dejavu exact"] = _with_tuning(forwards["dejavu exact"])
        shared.add(no_prefetch)
    timed = []
    for name, forward in forwards.items():  # each forward under generate(), then in a plain loop
        timed.append(Variant(name, lambda _, f=forward: f, compiled=name not in shared))
        timed.append(Variant(f"{name}, plain", run=lambda n, f=forward: _plain_steps(model, f, ids, n), compiled=False))
    speed = measure_decode(model, ids, timed, new_tokens=33, repeats=args.repeats)
    for name, (_, step_bytes) in variants.items():
        model.forward = forwards[name]
        categories = _profile_shares(model, ids)
        generate_step, plain_step = 1 / speed[name]["tokens_per_s"], 1 / speed[f"{name}, plain"]["tokens_per_s"]
        print(f"\n{name}: {1e3 * generate_step:.1f} ms per token in generate(), {1e3 * plain_step:.1f} ms per plain "
              f"step; weight-streaming floor {1e3 * step_bytes / rate:.1f} ms ({step_bytes / 1e6:.0f} MB)")
        print(f"  generate() loop: {1e3 * (generate_step - plain_step):5.1f} ms")
        for category, share in sorted(categories.items(), key=lambda kv: -kv[1]):
            print(f"  {category:<28}{1e3 * share * plain_step:5.1f} ms ({share:.0%})")
    model.forward = original
    return 0


def _with_tuning(forward, **settings):
    """``forward`` run under the kernels' machine tuning with ``settings`` in place (each call sets it:
    variants that differ only in a setting interleave)."""
    from dejavu_compile.kernels.cpu import native

    def run(*args, **kwargs):
        native.apply_tuning(**settings)
        return forward(*args, **kwargs)

    return run


def _step_weights(model) -> list[tuple]:
    """The weights a dense decode step reads, once each: (weight,) of every linear and the output head
    (SmolLM2's is its embedding), (qweight, scales) of every int8 projection."""
    from dejavu_compile.compiler.quantize import Int8Linear

    found = {}
    for module in model.modules():
        if isinstance(module, Int8Linear):
            found[id(module.qweight)] = (module.qweight, module.scales)
        elif isinstance(module, torch.nn.Linear):
            found[id(module.weight)] = (module.weight,)
    return list(found.values())


def step_weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for weights in _step_weights(model) for t in weights)


def streaming_rate(model) -> float:
    """Bytes per second the backend's GEMV reads the model's weight matrices at, each in its format
    (median of 7)."""
    from dejavu_compile.kernels.cpu import native

    native.load_ops()
    calls = []
    for weights in _step_weights(model):
        x = torch.randn(1, weights[0].shape[1], dtype=model.dtype)
        op = torch.ops.dejavu.cpu_q8_linear if len(weights) == 2 else torch.ops.dejavu.cpu_linear
        calls.append((op, (x, *(w.detach() for w in weights))))
    times = []
    for _ in range(8):
        start = time.perf_counter()
        for op, call_args in calls:
            op(*call_args)
        times.append(time.perf_counter() - start)
    return step_weight_bytes(model) / statistics.median(times[1:])


def _static_decoder(model, ids):
    """A step function over a fresh 128-slot static cache after the prompt's prefill: each call
    decodes one greedy token through the compiled forward."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=128)
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(ids.shape[1]))
    state = {"next": out.logits[:, -1:].argmax(-1), "pos": ids.shape[1]}

    @torch.no_grad()
    def step():
        o = model(input_ids=state["next"], past_key_values=cache, use_cache=True,
                  cache_position=torch.tensor([state["pos"]]))
        state["next"], state["pos"] = o.logits[:, -1:].argmax(-1), state["pos"] + 1

    return step


def _plain_steps(model, forward, ids, n: int) -> None:
    """The prompt's prefill and n - 1 decode steps of ``forward`` in a plain loop (no generate())."""
    model.forward = forward
    step = _static_decoder(model, ids)
    for _ in range(n - 1):
        step()


def _profile_shares(model, ids) -> dict[str, float]:
    """{category: share of the profiled self time} of 16 plain steps."""
    step = _static_decoder(model, ids)
    for _ in range(3):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(16):
            step()
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        name = event.key
        graph_code = name.startswith("## Call CompiledFxGraph")
        category = CATEGORIES.get(name, "compiled graph: kernels + wrapper" if graph_code else "other")
        totals[category] = totals.get(category, 0.0) + event.self_cpu_time_total
    whole = sum(totals.values())
    return {k: v / whole for k, v in totals.items()}


if __name__ == "__main__":
    raise SystemExit(main())
