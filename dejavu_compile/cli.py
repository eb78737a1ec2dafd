"""``dejavu-compile``: demo (the main job), bench, calibrate, explain.

Every command takes ``--model``: ``smollm2`` (the bundled SmolLM2-135M-Instruct, the default) or a
local Hugging Face model directory (read with ``local_files_only=True``). Bad arguments end in one
line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

import torch

DEMO_PROMPT = "The history of the city begins in the Roman period, when"
BUNDLED = "smollm2"
# Bumped when the default calibration changes: a plan cached by an older default is not reused.
DEFAULT_PLAN_VERSION = "v7"
PLAN_FILES = ("plan.json", "predictors.safetensors")


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block), exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _at_least_two(text: str) -> int:
    value = _int(text)
    if value is None or value < 2:
        # decode speed is (n - 1) tokens over t(n) - t(1): one new token measures nothing
        raise argparse.ArgumentTypeError(f"must be at least 2 (decode speed needs 2 new tokens), got {text!r}")
    return value


def _float(text: str) -> float:
    """float(text), NaN when it is not a number (every range check then fails)."""
    try:
        return float(text)
    except ValueError:
        return float("nan")


def _fraction(text: str) -> float:
    value = _float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _float(text)
    if not value > 0.0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


# ------------------------------------------------------------------------------------------ model


def _add_model_arg(ap) -> None:
    ap.add_argument("--model", default=BUNDLED,
                    help=f"'{BUNDLED}' (bundled SmolLM2-135M-Instruct, default) or a local Hugging Face model "
                         "directory (config.json, weights, tokenizer)")


def _check_model_arg(ap, spec: str) -> None:
    """Before any slow work: a model path must be a directory with a config.json."""
    if spec == BUNDLED:
        return
    path = Path(spec)
    if not path.is_dir():
        ap.error(f"--model {spec}: not a directory; pass '{BUNDLED}' or a local Hugging Face model directory")
    if not (path / "config.json").is_file():
        ap.error(f"--model {spec}: no config.json there; pass a directory written by save_pretrained")


def _load_model(ap, spec: str):
    """(model, tokenizer, name) in fp32 eval mode; a local model must have matched MLP blocks."""
    if spec == BUNDLED:
        from dejavu_compile.assets.models import load_smollm2

        print("loading SmolLM2-135M-Instruct ...")
        model, tok = load_smollm2()
        return model, tok, "SmolLM2-135M-Instruct"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(spec)
    name = path.resolve().name
    print(f"loading {name} from {path} ...")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        ap.error(f"--model {spec}: cannot load it as a causal LM with its tokenizer ({_one_line(exc)})")
    from dejavu_compile.compiler.explain import matched_blocks

    if not any(b.kind == "mlp" for b in matched_blocks(model)):
        ap.error(f"--model {spec}: the backend matches no MLP block in it, so there is nothing to make sparse; "
                 f"see `dejavu-compile explain {spec}`")
    return model, tok, f"{name} ({model.config.model_type})"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------- plans


def _default_plan_dir(model, spec: str) -> Path:
    """The cache directory for the default plan of a model (not user-named: may be refreshed)."""
    from dejavu_compile.cache import cache_dir

    if spec == BUNDLED:
        return cache_dir() / "plans" / f"smollm2-default-{DEFAULT_PLAN_VERSION}"
    from dejavu_compile.plan.sparsity_plan import model_fingerprint

    # Keyed by the weights: another checkpoint of the same name gets its own plan.
    weights = model_fingerprint(model)["weights_hash"]
    return cache_dir() / "plans" / f"{Path(spec).resolve().name}-{weights}-default-{DEFAULT_PLAN_VERSION}"


def _calibrate_into(model, tokenizer, plan_dir: Path, **calibrate_kwargs):
    from dejavu_compile.calibration.calibrate import calibrate

    print("calibrating a sparsity plan on the bundled Wikipedia calibration split ...")
    plan = calibrate(model, tokenizer, **calibrate_kwargs)
    plan.save(plan_dir)
    print(f"saved the plan to {plan_dir}")
    return plan


def load_or_calibrate(model, tokenizer, plan_dir, recalibrate: bool = False, **calibrate_kwargs):
    """The plan cached in ``plan_dir`` if it fits ``model``; else calibrate one and cache it there.
    For cache directories only: an unusable plan there is replaced."""
    from dejavu_compile.plan.sparsity_plan import SparsityPlan

    plan_dir = Path(plan_dir)
    if not recalibrate and (plan_dir / "plan.json").exists():
        try:
            plan = SparsityPlan.load(plan_dir, model)
            print(f"loaded the cached plan from {plan_dir}")
            return plan
        except ValueError as exc:
            print(f"cached plan in {plan_dir} is unusable ({exc}); calibrating again")
    return _calibrate_into(model, tokenizer, plan_dir, **calibrate_kwargs)


def _dir_state(path: Path) -> str:
    """'new' (absent or empty), 'plan' (holds plan files, maybe partial), 'other' (non-empty) or 'file'."""
    if not path.exists():
        return "new"
    if not path.is_dir():
        return "file"
    if any((path / f).exists() for f in PLAN_FILES):
        return "plan"
    return "other" if any(path.iterdir()) else "new"


def _check_writable_plan_dir(ap, option: str, path: Path, overwrite: bool) -> None:
    """A user-named directory is written only when new or empty, or with --overwrite."""
    state = _dir_state(path)
    if state == "file":
        ap.error(f"{option} {path} is a file; pass a directory")
    if state == "plan" and not overwrite:
        ap.error(f"{option} {path} already holds a plan; pass another directory, or --overwrite to replace it")
    if state == "other" and not overwrite:
        ap.error(f"{option} {path} is not empty and holds no plan; pass a new or empty directory, "
                 "or --overwrite to write the plan files into it")


def _resolve_plan(ap, args, model, tokenizer):
    """The plan for demo/bench, and where it lives.

    No --plan: the default cache directory, refreshed when its plan does not fit. A user-named
    --plan DIR is never overwritten silently: a plan there is loaded and must fit; a new or empty
    DIR receives a newly calibrated plan; --recalibrate over a plan needs --overwrite too.
    """
    from dejavu_compile.plan.sparsity_plan import SparsityPlan

    if args.plan is None:
        plan_dir = _default_plan_dir(model, args.model)
        return load_or_calibrate(model, tokenizer, plan_dir, recalibrate=args.recalibrate), plan_dir
    plan_dir = Path(args.plan)
    state = _dir_state(plan_dir)
    if state == "plan" and not args.recalibrate:
        try:
            plan = SparsityPlan.load(plan_dir, model)
        except ValueError as exc:
            ap.error(f"--plan {plan_dir} does not fit: {_one_line(exc)}; pass another --plan directory "
                     "(a new plan is calibrated there), or --recalibrate --overwrite to replace it")
        print(f"loaded the plan from {plan_dir}")
        return plan, plan_dir
    _check_writable_plan_dir(ap, "--plan", plan_dir, args.overwrite)
    return _calibrate_into(model, tokenizer, plan_dir), plan_dir


def _add_plan_args(ap) -> None:
    ap.add_argument("--plan", default=None,
                    help="plan directory: a plan there is loaded and must fit the model; a new or empty "
                         "directory gets a newly calibrated plan (default: a cached default plan)")
    ap.add_argument("--recalibrate", action="store_true",
                    help="calibrate again (over a plan in a --plan directory only with --overwrite)")
    ap.add_argument("--overwrite", action="store_true", help="allow replacing the plan in a --plan directory")


# ------------------------------------------------------------------------------ demo and bench


def machine() -> dict:
    from dejavu_compile.evaluation.bench import cpu_info

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return {"cpu": cpu_info()["name"], "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "accelerator": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "load_average": round(load, 2)}


def compare(model, tok, plan, prompt: str, new_tokens: int, repeats: int, eval_tokens: int) -> dict:
    """Decode speed of HF eager, Inductor dense and dejavu, and held-out perplexity dense vs the
    plan (masked simulation) on the bundled Wikipedia and news texts."""
    from dejavu_compile.assets.data import news_texts, tokenize_chunks, wiki_articles
    from dejavu_compile.compiler.prepare import prepare_model
    from dejavu_compile.evaluation.bandwidth import bandwidth_bound
    from dejavu_compile.evaluation.bench import Variant, compiled_forward, measure_decode
    from dejavu_compile.evaluation.perplexity import perplexity

    prepare_model(model)
    ids = tok(prompt, return_tensors="pt").input_ids
    reports = []
    variants = [Variant("HF eager"), Variant("Inductor dense", compiled_forward("inductor")),
                Variant("dejavu exact", compiled_forward("dejavu")),  # no plan: the dense step at the streaming rate
                Variant("dejavu", compiled_forward("dejavu", options={"plan": plan, "on_report": reports.append}))]
    speed = measure_decode(model, ids, variants, new_tokens=new_tokens, repeats=repeats)
    base = speed["Inductor dense"]["tokens_per_s"]
    for row in speed.values():
        row["vs_inductor"] = row["tokens_per_s"] / base

    wiki = tokenize_chunks(tok, wiki_articles("eval"), seq_len=256, max_tokens=eval_tokens)
    news = tokenize_chunks(tok, news_texts(), seq_len=256, max_tokens=max(2, eval_tokens // 2))
    quality = {}
    for name, chunks in (("wiki", wiki), ("news", news)):
        dense, sparse = perplexity(model, chunks, progress=True), perplexity(model, chunks, plan, progress=True)
        quality[name] = {"dense": dense, "dejavu": sparse, "increase": sparse / dense - 1,
                         "tokens": sum(c.numel() for c in chunks)}

    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    added = max((r.extra_bytes for r in reports), default=0)
    outputs = {v.name: tok.decode(v.outputs[0, ids.shape[1]:], skip_special_tokens=True) for v in variants}
    return {"speed": speed, "perplexity": quality, "bandwidth_bound": bandwidth_bound(model, plan),
            "extra_bytes": added, "weight_bytes": weights, "outputs": outputs}


def print_table(model_name: str, plan, plan_dir, result: dict, info: dict, new_tokens: int) -> None:
    print(f"\nmodel: {model_name}; plan {plan_dir}: MLP density {plan.mlp_density:.2f}, "
          f"attention density {plan.attn_density:.2f}")
    busy = info["load_average"] > (info["cpu_count"] or 1) + 1
    device = f", {info['accelerator']}" if info["accelerator"] else ""
    print(f"machine: {info['cpu']}{device}, {info['threads']} threads, torch {info['torch']}; "
          f"load average {info['load_average']:.1f}"
          + (" (other work is running: timings are not reliable)" if busy else ""))
    print(f"decode, batch 1, {new_tokens} new tokens, static cache:")
    print(f"{'variant':<16}{'tokens/s':>10}{'vs Inductor':>13}")
    for name, row in result["speed"].items():
        print(f"{name:<16}{row['tokens_per_s']:>10.2f}{row['vs_inductor']:>12.2f}x")
    # the bound is in bytes read; the speedup it bounds is over a dense step that reads at the streaming rate
    speed = result["speed"]
    bound, gain = result["bandwidth_bound"], speed["dejavu"]["tokens_per_s"] / speed["dejavu exact"]["tokens_per_s"]
    print(f"bandwidth bound at MLP density {plan.mlp_density:.2f} (weight bytes read, predictors included): "
          f"{bound:.2f}x; dejavu vs dejavu exact {gain:.2f}x, efficiency (speedup / bound) {gain / bound:.2f}")
    added = result["extra_bytes"]
    print(f"memory the decode graph adds (predictors, weight copies): {added / 2**20:.1f} MiB, "
          f"{added / result['weight_bytes']:.1%} of the model's weights")
    for name, q in result["perplexity"].items():
        print(f"held-out perplexity ({name}, {q['tokens']} tokens): dense {q['dense']:.2f}, dejavu {q['dejavu']:.2f} "
              f"({q['increase']:+.2%}; masked simulation of the plan)")


def _speed_parser(prog: str, description: str, new_tokens: int, eval_tokens: int):
    ap = _Parser(prog=prog, description=description)
    _add_model_arg(ap)
    ap.add_argument("--prompt", default=DEMO_PROMPT)
    ap.add_argument("--new-tokens", type=_at_least_two, default=new_tokens)
    ap.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per variant (median)")
    ap.add_argument("--threads", type=_positive_int, default=2)
    ap.add_argument("--eval-tokens", type=_positive_int, default=eval_tokens,
                    help="held-out Wikipedia tokens for perplexity (half as many news tokens)")
    _add_plan_args(ap)
    return ap


def _run_comparison(ap, args):
    _check_model_arg(ap, args.model)
    if args.plan is not None and (args.recalibrate or _dir_state(Path(args.plan)) in ("file", "other")):
        _check_writable_plan_dir(ap, "--plan", Path(args.plan), args.overwrite)  # refuse before loading
    _set_threads(args.threads)
    model, tok, name = _load_model(ap, args.model)
    plan, plan_dir = _resolve_plan(ap, args, model, tok)
    result = compare(model, tok, plan, args.prompt, args.new_tokens, args.repeats, args.eval_tokens)
    info = machine()
    print_table(name, plan, plan_dir, result, info, args.new_tokens)
    return name, plan, plan_dir, result, info


def demo(argv=None) -> int:
    ap = _speed_parser("dejavu-compile demo", "Dense eager vs Inductor vs dejavu on one model: decode speed, "
                       "held-out perplexity and the first words of each output.", 48, 4096)
    args = ap.parse_args(argv)
    _, _, _, result, _ = _run_comparison(ap, args)
    print("\nfirst words of each output:")
    for name, text in result["outputs"].items():
        print(f"  {name:<15}| " + textwrap.shorten(" ".join(text.split()), 100))
    return 0


def bench(argv=None) -> int:
    ap = _speed_parser("dejavu-compile bench", "The demo's speed and quality table, without sample outputs.", 32, 2048)
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    if args.json and Path(args.json).is_dir():
        ap.error(f"--json {args.json} is a directory; pass a file path")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        ap.error(f"--json {args.json}: its directory does not exist; create it or pass another path")
    name, plan, plan_dir, result, info = _run_comparison(ap, args)
    if args.json:
        record = {"model": name, "model_path": args.model, "plan": str(plan_dir),
                  "mlp_density": plan.mlp_density, "attn_density": plan.attn_density, "machine": info,
                  "prompt": args.prompt, "new_tokens": args.new_tokens, "repeats": args.repeats,
                  **{k: v for k, v in result.items() if k != "outputs"}}
        Path(args.json).write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}")
    return 0


# --------------------------------------------------------------------------------------- calibrate


def calibrate_cmd(argv=None) -> int:
    from dejavu_compile.calibration.calibrate import DEFAULT_MAX_TOKENS, calibrate
    from dejavu_compile.plan import predictors

    ap = _Parser(prog="dejavu-compile calibrate",
                 description="Calibrate a Deja Vu sparsity plan; writes a plan directory.")
    ap.add_argument("--out", required=True, help="new or empty directory to write the plan to")
    ap.add_argument("--overwrite", action="store_true", help="allow replacing a plan already in --out")
    _add_model_arg(ap)
    ap.add_argument("--density", type=_fraction, default=None,
                    help="average MLP density to keep, in (0, 1] (default: 0.6 with the int8 and int4 predictors, "
                         "0.98 with lowrank)")
    ap.add_argument("--attn-density", type=_fraction, default=1.0, help="average attention head density, in (0, 1]")
    ap.add_argument("--max-ppl-increase", type=_positive_float, default=None,
                    help="quality budget, e.g. 0.03 (overrides --density)")
    ap.add_argument("--texts", default=None, help="text file to calibrate on (default: bundled Wikipedia split)")
    ap.add_argument("--max-tokens", type=_positive_int, default=DEFAULT_MAX_TOKENS)
    ap.add_argument("--rank", type=_positive_int, default=None)
    ap.add_argument("--predictor", choices=("auto", *predictors.option_names()), default="auto",
                    help="lowrank: Deja Vu-style with lookahead; int8: the block's own gate/up in int8 (near-oracle); "
                         "int4: gate/up in 4 bits fitted to the calibration activations (learned, near-oracle, no "
                         "fast kernel yet); auto: int8 for gated MLPs on CPU, else lowrank")
    ap.add_argument("--values", choices=("auto", "exact", "predictor"), default="auto",
                    help="kept neurons' act(gate)*up: exact (fp32 weights) or from the int8 predictor (reads only "
                         "their down rows); auto: predictor with the int8 predictor")
    ap.add_argument("--allocation", choices=("auto", "uniform", "greedy"), default="auto",
                    help="spread of the MLP density over layers: uniform, or greedy on each layer's captured "
                         "mass; auto: uniform with the int8/int4 predictors, greedy with lowrank")
    ap.add_argument("--no-lookahead", action="store_true")
    ap.add_argument("--threads", type=_positive_int, default=None)
    args = ap.parse_args(argv)
    if args.texts and not Path(args.texts).is_file():
        ap.error(f"--texts {args.texts}: no such file; pass a UTF-8 text file (paragraphs split on blank lines)")
    out = Path(args.out)
    _check_writable_plan_dir(ap, "--out", out, args.overwrite)
    _check_model_arg(ap, args.model)
    _set_threads(args.threads)
    texts = None
    if args.texts:
        from dejavu_compile.assets.data import read_text_file

        texts = read_text_file(args.texts)
    model, tok, name = _load_model(ap, args.model)
    try:
        plan = calibrate(model, tok, texts, mlp_density=args.density, attn_density=args.attn_density,
                         lookahead=False if args.no_lookahead else None, rank=args.rank, predictor=args.predictor,
                         values=args.values, max_tokens=args.max_tokens, allocation=args.allocation,
                         max_ppl_increase=args.max_ppl_increase)
    except ValueError as exc:  # an option this model cannot take (e.g. int8 on plain MLPs), or empty texts
        ap.error(_one_line(exc))
    plan.save(out)
    print(plan.summary())
    print(f"wrote {out} for {name} (MLP density {plan.mlp_density:.3f}, {plan.settings.get('total_s')} s)")
    return 0


# ----------------------------------------------------------------------------------------- explain


def explain_cmd(argv=None) -> int:
    ap = _Parser(prog="dejavu-compile explain", description="What the backend matches in a model.")
    ap.add_argument("model", help=f"'{BUNDLED}', a tiny test architecture (llama, gpt2, ...), or a local HF directory")
    args = ap.parse_args(argv)
    from dejavu_compile.compiler.explain import explain
    from dejavu_compile.testing.tiny import ARCHITECTURES, tiny_model

    if args.model == BUNDLED:
        from dejavu_compile.assets.models import load_smollm2

        model, _ = load_smollm2()
    elif args.model in ARCHITECTURES:
        model = tiny_model(args.model)
    else:
        _check_model_arg(ap, args.model)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True).eval()
    print(explain(model, torch.tensor([[1, 2, 3, 4]])))
    return 0


COMMANDS = {"demo": demo, "bench": bench, "calibrate": calibrate_cmd, "explain": explain_cmd}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: dejavu-compile {demo,bench,calibrate,explain} [--model smollm2|HF_DIR] [options]\n"
              "  demo       dense vs dejavu: tokens/s, perplexity, outputs (the main job; SmolLM2-135M by default)\n"
              "  bench      the demo's speed and quality table without outputs; --json PATH writes the figures\n"
              "  calibrate  fit predictors and choose k per layer; writes a plan directory (--out DIR)\n"
              "  explain    show which decoder blocks the backend matches in a model")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
