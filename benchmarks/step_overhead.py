"""What a SmolLM2 decode step costs outside the compiled graph on the CPU, and how much of that is the
cache the weights evict.

    python benchmarks/step_overhead.py --weights int8 --out benchmarks/results/step-overhead-int8-avx2.json
    python benchmarks/step_overhead.py               # fp32 weights

One compiled forward (dejavu exact: no plan, every projection through the backend's GEMV), called in a
plain loop of decode steps over one static cache (batch 1, 2 threads unless --threads). The backend
is wrapped so that the time inside each call of the compiled graph (AOTAutograd's wrappers,
Inductor's C++ wrapper, the kernels) is recorded, and so that the graph can be replaced by a no-op
that returns its last outputs. What remains with the no-op graph is the cost outside it: Dynamo's
guard evaluation, its frame and argument handling, and the model's Python around the graph. That
cost is measured with the caches warm (steps back to back) and after streaming as many bytes as the
step's weights through the cache, which is what a real step leaves behind; each also with Dynamo's
guard evaluation skipped (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``, which still
checks the tensor guards of non-parameter inputs). Variants alternate within each round; each
figure is the median over rounds of a round's median step.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


class TimedBackend:
    """The dejavu backend, with each compiled graph's calls timed (``times``) and, while ``noop`` is
    set, answered with the graph's last outputs instead of running it."""

    def __init__(self, options: dict):
        self.options = options
        self.times: list[float] = []
        self.noop = False
        self.inputs: list[int] = []  # arguments each compiled graph takes

    def __call__(self, gm, example_inputs):
        from dejavu_compile.compiler.backend import dejavu_backend

        compiled = dejavu_backend(gm, example_inputs, options=self.options)
        self.inputs.append(len(example_inputs))
        last = []

        def run(*args):
            if self.noop and last:
                return last[0]
            start = time.perf_counter()
            out = compiled(*args)
            self.times.append(time.perf_counter() - start)
            last[:] = [out]
            return out

        return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default="float", choices=["float", "int8"],
                    help="int8: dejavu_compile.quantize_weights(model, 'int8')")
    ap.add_argument("--steps", type=int, default=40, help="decode steps per variant and round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None, help="JSON results file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import StaticCache

    from dejavu_compile.cli import DEMO_PROMPT
    from dejavu_compile.compiler.quantize import resident_bytes
    from dejavu_compile.evaluation.bench import cpu_machine_description, prepared_smollm2, write_result
    from dejavu_compile.evaluation.decode import cache_keyword

    model, tok = prepared_smollm2(args.weights)
    machine = cpu_machine_description()
    print(f"machine: {machine}")
    weight_bytes = resident_bytes(model)
    sweep = torch.ones(weight_bytes // 4)  # streamed before a step: what the step's own weights leave in the cache

    backend = TimedBackend({})
    model.forward = torch.compile(model.forward, backend=backend)
    ids = tok(DEMO_PROMPT, return_tensors="pt").input_ids
    prompt = ids.shape[1]
    keyword = cache_keyword(model)
    token = ids[:, -1:].clone(memory_format=torch.contiguous_format)

    def steps(streamed: bool, noop: bool = False, skip_guards: bool = False) -> float:
        """Median time of args.steps decode steps after a prefill of the prompt, on a new static cache
        (the cache counts the tokens it has taken); the prefill runs the real graph."""
        cache = StaticCache(config=model.config, max_cache_len=prompt + args.steps)
        backend.noop = False
        model(input_ids=ids, use_cache=True, cache_position=torch.arange(prompt), **{keyword: cache})
        backend.noop = noop
        times = []
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip_guards):
            for position in range(prompt, prompt + args.steps):
                cache_position = torch.tensor([position])
                if streamed:
                    sweep.sum()
                start = time.perf_counter()
                model(input_ids=token, use_cache=True, cache_position=cache_position, **{keyword: cache})
                times.append(time.perf_counter() - start)
        backend.noop = False
        return statistics.median(times)

    variants = {  # name: (graph replaced by the no-op, guards skipped, weights' bytes streamed first)
        "decode step": (False, False, False),
        "no-op graph, warm": (True, False, False),
        "no-op graph, warm, guards skipped": (True, True, False),
        "no-op graph, after streaming": (True, False, True),
        "no-op graph, after streaming, guards skipped": (True, True, True),
    }
    with torch.no_grad():
        steps(False)  # compiles the prefill and decode graphs
        graphs = len(backend.inputs)
        results = {name: [] for name in variants}
        inside = []
        for _ in range(args.rounds):
            for name, (noop, skip_guards, streamed) in variants.items():
                backend.times.clear()
                results[name].append(steps(streamed, noop, skip_guards))
                if not noop:  # the decode steps' calls (the prefill's is the first)
                    inside.append(statistics.median(backend.times[1:]))
    if len(backend.inputs) != graphs:
        raise RuntimeError(f"the timed steps compiled {len(backend.inputs) - graphs} more graph(s); "
                           "the variants must all run the decode graph compiled first")

    ms = {name: 1e3 * statistics.median(values) for name, values in results.items()}
    inside_ms = 1e3 * statistics.median(inside)
    print(f"\nSmolLM2-135M, {args.weights} weights, dejavu exact, plain decode loop, {args.threads} threads; "
          f"the decode graph takes {backend.inputs[-1]} arguments")
    print(f"decode step                                {ms['decode step']:6.2f} ms")
    print(f"  inside the compiled graph                {inside_ms:6.2f} ms")
    print(f"  outside it (Dynamo, the model's Python)  {ms['decode step'] - inside_ms:6.2f} ms")
    print(f"the step with a no-op graph (outside cost only); {weight_bytes / 1e6:.0f} MB streamed = the weights")
    print(f"  {'':<26}{'warm':>8}{'after streaming':>18}")
    for label, suffix in (("guards evaluated", ""), ("guards skipped", ", guards skipped")):
        warm, streamed = ms["no-op graph, warm" + suffix], ms["no-op graph, after streaming" + suffix]
        print(f"  {label:<26}{warm:8.2f}{streamed:18.2f} ms")
    if args.out:
        record = dict(machine=machine, threads=args.threads, weights=args.weights, variant="dejavu exact",
                      steps_per_round=args.steps, rounds=args.rounds, weight_bytes=weight_bytes,
                      decode_graph_arguments=backend.inputs[-1], step_ms=ms,
                      inside_compiled_graph_ms=inside_ms, outside_compiled_graph_ms=ms["decode step"] - inside_ms,
                      rounds_ms={name: [1e3 * v for v in values] for name, values in results.items()})
        write_result(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
