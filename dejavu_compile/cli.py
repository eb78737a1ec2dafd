"""``dejavu-compile``: demo (the main job), calibrate, explain."""
from __future__ import annotations

import argparse
import os
import sys
import textwrap

import torch

DEMO_PROMPT = "The history of the city begins in the Roman period, when"


def _default_plan_dir():
    from dejavu_compile.cache import cache_dir

    # Versioned: a plan cached by an older default calibration is not silently reused.
    return cache_dir() / "plans" / "smollm2-default-v5"


def load_or_calibrate(model, tokenizer, plan_dir, recalibrate: bool = False, **calibrate_kwargs):
    """The plan cached in ``plan_dir`` if it fits ``model``; else calibrate one and cache it."""
    from dejavu_compile.calibration.calibrate import calibrate
    from dejavu_compile.plan.sparsity_plan import SparsityPlan

    if not recalibrate and (plan_dir / "plan.json").exists():
        try:
            plan = SparsityPlan.load(plan_dir)
            plan.check(model)
            print(f"loaded the cached plan from {plan_dir}")
            return plan
        except ValueError as exc:
            print(f"cached plan in {plan_dir} is unusable ({exc}); calibrating again")
    print("calibrating a sparsity plan on the bundled Wikipedia calibration split (first run only) ...")
    plan = calibrate(model, tokenizer, **calibrate_kwargs)
    plan.save(plan_dir)
    print(f"saved the plan to {plan_dir}")
    return plan


def demo(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dejavu-compile demo",
                                 description="SmolLM2-135M: dense eager vs Inductor vs dejavu, speed and quality.")
    ap.add_argument("--prompt", default=DEMO_PROMPT)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plan", default=None, help="plan directory (default: cached default plan)")
    ap.add_argument("--recalibrate", action="store_true")
    ap.add_argument("--eval-tokens", type=int, default=4096, help="held-out tokens for perplexity")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from pathlib import Path

    from dejavu_compile.evaluation.bench import Variant, compiled_forward, machine_description, measure_decode
    from dejavu_compile.assets.data import news_texts, tokenize_chunks, wiki_articles
    from dejavu_compile.evaluation.perplexity import perplexity
    from dejavu_compile.assets.models import load_smollm2
    from dejavu_compile.compiler.prepare import prepare_model
    from dejavu_compile.evaluation.bandwidth import bandwidth_bound

    print("loading SmolLM2-135M-Instruct ...")
    model, tok = load_smollm2()
    plan_dir = Path(args.plan) if args.plan else _default_plan_dir()
    plan = load_or_calibrate(model, tok, plan_dir, recalibrate=args.recalibrate)
    prepare_model(model)
    print(f"plan: MLP density {plan.mlp_density:.2f}, attention density {plan.attn_density:.2f}")

    ids = tok(args.prompt, return_tensors="pt").input_ids
    reports = []
    variants = [Variant("HF eager", lambda f: f), Variant("Inductor dense", compiled_forward("inductor")),
                Variant("dejavu", compiled_forward("dejavu", options={"plan": plan, "on_report": reports.append}))]
    speed = measure_decode(model, ids, variants, new_tokens=args.new_tokens, repeats=args.repeats)

    wiki = tokenize_chunks(tok, wiki_articles("eval"), seq_len=256, max_tokens=args.eval_tokens)
    news = tokenize_chunks(tok, news_texts(), seq_len=256, max_tokens=args.eval_tokens // 2)
    ppl = {}
    for name, chunks in (("wiki", wiki), ("news", news)):
        ppl[name] = (perplexity(model, chunks, progress=True), perplexity(model, chunks, plan, progress=True))

    base = speed["Inductor dense"]["tokens_per_s"]
    bound = bandwidth_bound(model, plan)
    load = os.getloadavg()[0]
    print(f"\nmachine: {machine_description()}; load average {load:.1f}"
          + (" (other work is running: timings are not reliable)" if load > os.cpu_count() + 1 else ""))
    print(f"{'variant':<16}{'tokens/s':>10}{'vs Inductor':>13}")
    for name, row in speed.items():
        print(f"{name:<16}{row['tokens_per_s']:>10.2f}{row['tokens_per_s'] / base:>12.2f}x")
    gain = speed["dejavu"]["tokens_per_s"] / base
    print(f"bandwidth bound at MLP density {plan.mlp_density:.2f} (weight bytes read, predictors included): "
          f"{bound:.2f}x; efficiency (speedup / bound): {gain / bound:.2f}")
    added = max((r.extra_bytes for r in reports), default=0)
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    print(f"memory the decode graph adds (predictors, weight copies): {added / 2**20:.1f} MiB, "
          f"{added / weights:.1%} of the model's weights")
    for name, (dense, sparse) in ppl.items():
        print(f"held-out perplexity ({name}): dense {dense:.2f}, dejavu {sparse:.2f} "
              f"({sparse / dense - 1:+.2%}; masked simulation of the plan)")
    print("\nfirst words of each output:")
    for v in variants:
        text = tok.decode(v.outputs[0, ids.shape[1]:], skip_special_tokens=True)
        print(f"  {v.name:<15}| " + textwrap.shorten(" ".join(text.split()), 100))
    return 0


def explain_cmd(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dejavu-compile explain", description="What the backend matches in a model.")
    ap.add_argument("model", help="'smollm2', a tiny test architecture (llama, gpt2, ...), or a local HF directory")
    args = ap.parse_args(argv)
    from dejavu_compile.compiler.explain import explain
    from dejavu_compile.testing.tiny import ARCHITECTURES, tiny_model

    if args.model == "smollm2":
        from dejavu_compile.assets.models import load_smollm2

        model, _ = load_smollm2()
    elif args.model in ARCHITECTURES:
        model = tiny_model(args.model)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    print(explain(model, torch.tensor([[1, 2, 3, 4]])))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": demo, "explain": explain_cmd}
    if argv and argv[0] == "calibrate":
        from dejavu_compile.calibration.calibrate import main_calibrate

        return main_calibrate(argv[1:])
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: dejavu-compile {demo,calibrate,explain} [options]\n"
              "  demo       SmolLM2-135M dense vs dejavu: tokens/s, perplexity, outputs (the main job)\n"
              "  calibrate  train predictors and choose k per layer; writes a plan directory\n"
              "  explain    show which decoder blocks the backend matches in a model")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
