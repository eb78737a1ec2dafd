"""Dense model -> SparsityPlan: collect activations, fit predictors, choose k per layer.

    plan = calibrate(model, tokenizer)                 # bundled Wikipedia calibration split
    plan = calibrate(model, tokenizer, texts=[...], mlp_density=0.6)
    plan = calibrate(model, tokenizer, values="exact")   # kept neurons computed from the fp32 weights
    plan = calibrate(model, tokenizer, max_ppl_increase=0.03)   # quality budget instead of density
    plan.settings["quality"]   # {"dense_ppl", "plan_ppl", "increase", "tokens", ...} on held-out tokens

`calibrate` runs named steps: collect_calibration_data -> choose_options -> fit_layers ->
(per density) allocate_k -> build_entries -> record_settings -> check_quality; with a quality
budget, lowest_density_within_budget repeats allocate_k to record_settings and measures each plan.
Per-block facts (gated or not, activation, weights) come from the matched block records, never
from config attribute names. Default operating points and their measurements: benchmarks/README.md.

Quality is measured, not assumed: the last calibration batches (at most HOLDOUT_TOKENS tokens) are
held out from collection, and the returned plan's perplexity on them, through the backend's masked
simulation, is stored in ``plan.settings["quality"]``; above `warn_ppl_increase` calibrate warns
(PlanQualityWarning).
Default operating points and their measurements: benchmarks/README.md.

CLI: `dejavu-compile calibrate --out DIR [--density D] ...` (dejavu_compile/cli.py).
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field

import torch

from dejavu_compile.calibration import budget
from dejavu_compile.calibration.collect import collect
from dejavu_compile.plan import predictors, rules
from dejavu_compile.plan.predictors.metrics import mass_captured, mass_curve, recall
from dejavu_compile.plan.predictors.registry import FitInputs
from dejavu_compile.plan.sparsity_plan import (
    DEFAULT_DOWN_ROWS,
    PlanEntry,
    SparsityPlan,
    check_down_rows,
    check_head_candidates,
    default_head_candidates,
    model_fingerprint,
)

# calibrate's `predictor` option -> (kind for gated MLPs, kind for plain MLPs or None: gated only)
DEFAULT_RANK_FRACTION = 0.25  # predictor rank r = fraction * d (per projection of the low-rank gated predictor)
DEFAULT_MAX_TOKENS = 8192
DEFAULT_SEQ_LEN = 256
# Held out from collection for the quality check: the batches beyond max_tokens, topped up to a
# tenth of a short text, at most this many tokens (a dense and a simulated pass over them: seconds).
HOLDOUT_TOKENS = 1024
HOLDOUT_SHARE = 0.1
# calibrate warns above this perplexity increase on the held-out tokens. SmolLM2-135M's default plan
# (int8, density 0.6) measures about +1% (README, Results): 5% flags a plan well off that point.
DEFAULT_WARN_PPL_INCREASE = 0.05


class PlanQualityWarning(UserWarning):
    """The calibrated plan raises perplexity on held-out calibration tokens above `warn_ppl_increase`."""


@dataclass
class CalibrationData:
    samples: dict  # layer -> LayerSamples
    mlp_blocks: dict  # layer -> matched MLPBlock
    heads: dict  # layer -> query heads of its matched attention block
    holdout: list  # held-out token chunks for the quality check (empty: nothing held out)
    holdout_reason: str | None  # why nothing is held out, when so
    collect_s: float


@dataclass
class Options:
    """calibrate's options with every "auto" resolved."""

    predictor: str
    values: str
    lookahead: bool
    mlp_density: float
    allocation: str


@dataclass
class LayerFit:
    """One layer's fitted predictors and how they score the held-back tokens."""

    mlp_kind: str
    mlp_tensors: dict
    mlp_scores: torch.Tensor  # (N_val, F)
    mlp_importance: torch.Tensor  # (N_val, F)
    mlp_curve: dict  # k -> 1 - captured mass
    grid_multiple: int  # k is kept a multiple of this (wide layers)
    predictor_cost: float  # bytes the predictor reads, as a share of the dense block's
    attn_tensors: dict | None = None
    attn_scores: torch.Tensor | None = None
    attn_importance: torch.Tensor | None = None
    attn_curve: dict = field(default_factory=dict)

    @property
    def neurons(self) -> int:
        return self.mlp_importance.shape[1]

    @property
    def heads(self) -> int | None:
        return None if self.attn_importance is None else self.attn_importance.shape[1]


def calibrate(
    model,
    tokenizer,
    texts=None,
    mlp_density: float | None = None,
    attn_density: float = 1.0,
    lookahead: bool | None = None,
    rank: int | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    seq_len: int = DEFAULT_SEQ_LEN,
    min_density: float = 0.125,
    allocation: str = "auto",
    max_ppl_increase: float | None = None,
    warn_ppl_increase: float | None = DEFAULT_WARN_PPL_INCREASE,
    predictor: str = "auto",
    values: str = "auto",
    train_steps: int = 400,
    dense_when_unprofitable: bool = True,
    head_candidates: int | None = None,
    down_rows: str = DEFAULT_DOWN_ROWS,
    progress: bool = True,
    seed: int = 0,
    samples=None,
    return_builder: bool = False,
) -> SparsityPlan:
    """Calibrate a sparsity plan for `model` on `texts`.

    Gated MLPs (LLaMA, Qwen, Mistral: act(gate(x)) * up(x)) get the low-rank gated predictor or a
    quantized copy of gate/up; plain MLPs (OPT, GPT-2: act(up(x))) get Deja Vu's two-layer low-rank
    predictor, trained with binary cross-entropy to flag each token's top neurons at the target density.

    texts: list of strings, a single string, or None for the bundled Wikipedia calibration split.
    mlp_density / attn_density: target average fraction of MLP neurons / query heads kept (mlp_density
        None: the predictor kind's ``default_density``).
    lookahead: predictors read the previous block's input (can run beside it). None: with the
        low-rank predictor (Deja Vu's setting), not with int4; never with int8 (it is the block's own
        projection).
    allocation: how the MLP density budget is spread over layers: "uniform" (every layer keeps the
        same share, on a grid of 32 neurons), "greedy" (`budget.allocate` on each layer's curve of
        1 - captured |activation| mass: layers where the predictor is poor stay denser) or "auto"
        (uniform for the quantized predictors, which are near the oracle everywhere; greedy for
        the low-rank ones).
    dense_when_unprofitable: keep a layer dense when its kept rows plus its predictor would read at
        least as many bytes as the dense block (the plan's density can then exceed the target).
    predictor: "lowrank" (Deja Vu-style, rank `rank`, with lookahead), "int8" (the block's own
        gate/up weights in int8, reads the block's own input), "int4" (gated MLPs: a 4-bit copy of
        gate/up fitted to the collected activations, exact values only) or "auto" (int8 when every
        MLP is gated and the model is on the CPU, else lowrank). See `dejavu_compile.plan.predictors`.
    values: where the kept neurons' act(gate) * up come from: "exact" (the block's own fp32 weights),
        "predictor" (the int8 predictor's own values, which it computes for every neuron anyway: the
        sparse block then reads only the kept rows of its down projection; int8 only) or "auto"
        ("predictor" with the int8 predictor, else "exact").
    train_steps: optimizer steps of each trained (plain-MLP) predictor; more steps, better recall.
    head_candidates: decode steps compute the output head from an int8 copy of its weight and
        recompute the logits of the top `head_candidates` tokens of each row exactly (0: the head
        stays dense). None: 64 when the head has at least 4,096 rows (``default_head_candidates``).
    down_rows: where MLPs whose values come from the int8 predictor read their kept down rows on CPU
        fp32: "bfloat16" (a copy built at compile time, half the bytes) or "model" (the model's own
        fp32 weights).
    max_ppl_increase: instead of `mlp_density`, the lowest density (grid of 0.05) whose perplexity
        increase on the held-out calibration tokens stays within this relative budget (e.g. 0.03).
    warn_ppl_increase: the plan's perplexity increase on the held-out calibration tokens (the last
        batches of the text, at most HOLDOUT_TOKENS, never collected) is measured through the
        backend's masked simulation and stored in ``plan.settings["quality"]``; above this bound
        calibrate warns (PlanQualityWarning) with the figure. None: not measured.
    samples: precomputed `collect` output (skips collection; for experiments and tests). Nothing is
        held out then: ``settings["quality"]`` is None and ``settings["quality_note"]`` says why.
    return_builder: return `build(mlp_density) -> SparsityPlan` instead of a plan, to make plans of
        several densities from one fit (attention density stays `attn_density`).
    """
    _check_choices(predictor, values, allocation)
    _check_collection(tokenizer, samples, max_tokens, seq_len)
    _check_float_weights(model)
    check_down_rows(down_rows)
    if head_candidates is None:
        head = model.get_output_embeddings()
        head_candidates = default_head_candidates(None if head is None else head.weight.shape[0])
    check_head_candidates(head_candidates)
    t0 = time.time()
    if samples is not None and max_ppl_increase is not None:
        raise ValueError("max_ppl_increase measures plans on calibration tokens held out from collection; with "
                         "precomputed samples= there are none: pass texts (and a tokenizer) instead of samples")
    data = collect_calibration_data(model, tokenizer, texts, samples, max_tokens, seq_len,
                                    with_holdout=max_ppl_increase is not None or warn_ppl_increase is not None,
                                    progress=progress)
    options = choose_options(model, data, predictor, values, lookahead, mlp_density, allocation)
    n = data.samples[min(data.samples)].mlp_input.shape[0]
    fit_idx, val_idx = _split(n, 0.8, seed)
    r = rank or max(8, int(round(DEFAULT_RANK_FRACTION * data.mlp_blocks[min(data.samples)].hidden_size)))
    fits = fit_layers(model, data, options, fit_idx, val_idx, r, attn_density, min_density, train_steps, seed, progress)
    fingerprint = model_fingerprint(model)
    facts = {"attn_density": attn_density, "rank": r, "max_tokens": max_tokens, "seq_len": seq_len,
             "tokens_collected": n, "min_density": min_density, "seed": seed, "max_ppl_increase": max_ppl_increase,
             "dense_when_unprofitable": dense_when_unprofitable, "collect_s": round(data.collect_s, 1)}

    def build(density: float) -> SparsityPlan:
        kmlp, katt = allocate_k(fits, options, density, attn_density, dense_when_unprofitable)
        entries = build_entries(fits, data, options, kmlp, katt)
        settings = record_settings(options, data.mlp_blocks, fits, density, facts, time.time() - t0)
        settings["head_candidates"] = head_candidates
        settings["down_rows"] = down_rows
        return SparsityPlan(entries, fingerprint, settings)

    if return_builder:  # one fit, many densities (benchmarks)
        return build
    if max_ppl_increase is None:
        plan = build(options.mlp_density)
        check_quality(model, plan, data, warn_ppl_increase, progress)
    else:
        plan = lowest_density_within_budget(model, data.holdout, build, max_ppl_increase, fingerprint, progress)
    plan.settings["total_s"] = round(time.time() - t0, 1)
    return plan


def _check_choices(predictor: str, values: str, allocation: str) -> None:
    if predictor != "auto":
        predictors.option_kinds(predictor)  # raises, naming the registered aliases
    if values not in ("auto", "exact", "predictor"):
        raise ValueError(f"values must be 'auto', 'exact' or 'predictor', got {values!r}")
    if allocation not in ("auto", "uniform", "greedy"):
        raise ValueError(f"allocation must be 'auto', 'uniform' or 'greedy', got {allocation!r}")


def _check_float_weights(model) -> None:
    """calibrate fits predictors to float weights: a model of quantize_weights' int8 projections is
    refused (its gated MLPs need no predictor: ``options={"mlp_density": ...}`` uses their own int8
    gate/up, or calibrate the float model before quantizing it)."""
    from dejavu_compile.compiler.quantize import Int8Linear

    if any(isinstance(m, Int8Linear) for m in model.modules()):
        raise ValueError("calibrate fits predictors to float weights, and this model holds int8 projections "
                         "(quantize_weights): calibrate the float model before quantizing it, or compile the int8 "
                         "model with options={'mlp_density': ...}, whose int8 MLPs choose their neurons with their "
                         "own gate/up")


def _check_collection(tokenizer, samples, max_tokens, seq_len) -> None:
    for name, value in (("max_tokens", max_tokens), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int (tokens), got {value!r}")
    if samples is None and tokenizer is None:
        raise ValueError("calibrate needs the model's tokenizer to turn the calibration text into token ids "
                         "(or precomputed samples=)")


def split_holdout(chunks: list, max_tokens: int, seq_len: int) -> tuple[list, list]:
    """(chunks to collect, chunks held out for the quality check): the last chunks, as many as lie
    beyond `max_tokens`, topped up to HOLDOUT_SHARE of the chunks, at most HOLDOUT_TOKENS tokens and
    at least one; none when there is a single chunk. With text to spare the collected chunks are
    the ones collection would take without a hold-out."""
    if len(chunks) < 2:
        return chunks, []
    beyond = len(chunks) - math.ceil(max_tokens / seq_len)
    n = max(1, min(max(beyond, int(HOLDOUT_SHARE * len(chunks))), _holdout_chunks(seq_len)))
    return chunks[:-n], chunks[-n:]


def _holdout_chunks(seq_len: int) -> int:
    return max(1, HOLDOUT_TOKENS // seq_len)  # one chunk when a chunk is longer than HOLDOUT_TOKENS


def collect_calibration_data(model, tokenizer, texts, samples, max_tokens: int, seq_len: int,
                             with_holdout: bool, progress: bool) -> CalibrationData:
    """Block inputs and true importance per layer (`collect`, unless `samples` are given), the
    matched MLP blocks, and the token chunks held out from collection (`split_holdout`) for the
    quality check."""
    from dejavu_compile.assets.data import tokenize_chunks, wiki_articles

    t0 = time.time()
    holdout, blocks, reason = [], None, None
    if samples is None:
        if texts is None:
            texts = wiki_articles("calibration")
        extra = _holdout_chunks(seq_len) * seq_len if with_holdout else 0
        chunks = tokenize_chunks(tokenizer, texts, seq_len, max_tokens + extra)
        if with_holdout:
            chunks, holdout = split_holdout(chunks, max_tokens, seq_len)
            if not holdout:
                reason = "the calibration text is a single batch: nothing to hold out"
        samples, blocks = collect(model, chunks, max_tokens=max_tokens, progress=progress)
    else:
        reason = "calibrated from precomputed samples: no token batches to hold out"
    if not with_holdout:
        reason = "not measured (warn_ppl_increase=None)"
    if blocks is None:
        from dejavu_compile.compiler.explain import matched_blocks

        blocks = matched_blocks(model)
    mlp_blocks = {b.layer: b for b in blocks if b.kind == "mlp"}
    heads = {b.layer: b.num_heads for b in blocks if b.kind == "attention"}
    missing = [l for l in sorted(samples) if l not in mlp_blocks]
    if missing:
        raise ValueError(f"layers {missing} have samples but no matched MLP block")
    return CalibrationData(samples, mlp_blocks, heads, holdout, reason, time.time() - t0)


def choose_options(model, data: CalibrationData, predictor, values, lookahead, mlp_density, allocation) -> Options:
    """Resolve the "auto" options from the matched blocks and the model's device."""
    all_gated = all(data.mlp_blocks[l].gated for l in data.samples)
    if predictor == "auto":
        predictor = predictors.auto_option(next(model.parameters()).device.type, all_gated)
    kind, plain_kind = predictors.option_kinds(predictor)
    if values == "auto":
        values = "predictor" if kind.gives_values else "exact"
    if values == "predictor" and not kind.gives_values:
        givers = [o for o in predictors.option_names() if predictors.option_kinds(o)[0].gives_values]
        raise ValueError(f"values='predictor' takes the kept neurons' values from the predictor: use predictor="
                         f"{' or '.join(map(repr, givers))} (or values='exact')")
    if kind.needs_own_input:
        lookahead = False  # it is the block's own projection: it needs the block's own input
    elif lookahead is None:
        lookahead = kind.default_lookahead
    if allocation == "auto":
        allocation = kind.default_allocation
    if plain_kind is None and not all_gated:
        plain = [o for o in predictors.option_names() if predictors.option_kinds(o)[1] is not None]
        raise ValueError(f"predictor={predictor!r} scores gated MLPs (act(gate(x)) * up(x)) with a copy of their "
                         f"weights; this model's MLPs are plain (act(up(x))): use predictor="
                         f"{' or '.join(map(repr, plain))}")
    density = kind.default_density if mlp_density is None else mlp_density
    return Options(predictor, values, lookahead, density, allocation)


def fit_layers(model, data: CalibrationData, options: Options, fit_idx, val_idx, rank: int, attn_density: float,
               min_density: float, train_steps: int, seed: int, progress: bool) -> dict[int, LayerFit]:
    """Per layer: fit the MLP block's predictor through its kind, and (attn_density < 1) the heads'
    two-layer predictor; score the held-back tokens and record captured-mass curves over k."""
    from tqdm.auto import tqdm

    element_size = next(model.parameters()).element_size()
    fits = {}
    for l in tqdm(sorted(data.samples), desc="train predictors", disable=not progress, unit="layer"):
        s, block = data.samples[l], data.mlp_blocks[l]
        fits[l] = fit_mlp_predictor(model, s, block, options, fit_idx, val_idx, rank, min_density, train_steps,
                                    seed, element_size)
        if attn_density < 1.0:
            previous = data.samples.get(l - 1) if options.lookahead and l > 0 else None
            fit_head_predictor(fits[l], s, previous, fit_idx, val_idx, min_density, seed)
    return fits


def fit_mlp_predictor(model, s, block, options: Options, fit_idx, val_idx, rank: int, min_density: float,
                      train_steps: int, seed: int, element_size: int) -> LayerFit:
    gated_kind, plain_kind = predictors.option_kinds(options.predictor)
    kind = gated_kind if block.gated else plain_kind
    name = kind.name
    x_in = s.attn_input if options.lookahead else s.mlp_input  # lookahead: this layer's attention input
    total = s.mlp_importance.shape[1]
    tensors = kind.fit(FitInputs(
        x=x_in[fit_idx], x_block=s.mlp_input[fit_idx], importance=s.mlp_importance[fit_idx],
        gate=_weight_rows(model, block.gate) if block.gated else None, up=_weight_rows(model, block.up),
        k=max(1, round(options.mlp_density * total)), rank=rank, steps=train_steps, seed=seed,
        lookahead=options.lookahead))
    with torch.no_grad():
        scores = kind.scores(tensors, x_in[val_idx], block.activation)
    importance = s.mlp_importance[val_idx]
    multiple = rules.k_multiple(total)
    grid = rules.k_grid(total, min_density, 20, multiple=multiple)
    curve = {k: 1.0 - m for k, m in mass_curve(scores, importance, grid).items()}
    return LayerFit(name, tensors, scores, importance, curve, multiple,
                    rules.predictor_share(kind, tensors, block.gated, block.hidden_size, total, element_size))


def fit_head_predictor(fit: LayerFit, s, previous, fit_idx, val_idx, min_density: float, seed: int) -> None:
    """The registry's head predictor kind for the query heads (Deja Vu's two-layer predictor, a
    listwise loss that serves every k); reads the previous layer's MLP input with lookahead."""
    xa = previous.mlp_input if previous is not None else s.attn_input
    heads = s.attn_importance.shape[1]
    kind = predictors.head_kind()
    fit.attn_tensors = kind.fit_heads(xa[fit_idx], s.attn_importance[fit_idx], seed)
    with torch.no_grad():
        fit.attn_scores = kind.scores(fit.attn_tensors, xa[val_idx], "identity")
    fit.attn_importance = s.attn_importance[val_idx]
    grid = rules.k_grid(heads, min(min_density, 1.0 / heads), heads)
    fit.attn_curve = {k: 1.0 - m for k, m in mass_curve(fit.attn_scores, fit.attn_importance, grid).items()}


def allocate_k(fits: dict[int, LayerFit], options: Options, density: float, attn_density: float,
               dense_when_unprofitable: bool) -> tuple[dict[int, int], dict[int, int]]:
    """Kept neurons and heads per layer for an average MLP `density`."""
    if options.allocation == "uniform":
        kmlp = {l: rules.uniform_k(f.neurons, density, f.grid_multiple) for l, f in fits.items()}
    else:
        kmlp = budget.allocate({l: f.mlp_curve for l, f in fits.items()}, {l: f.neurons for l, f in fits.items()},
                               density)
    if dense_when_unprofitable:  # a layer whose rows plus predictor outweigh the dense block
        kmlp = {l: (k if rules.sparse_pays(k, fits[l].neurons, options.values, fits[l].predictor_cost)
                    else fits[l].neurons) for l, k in kmlp.items()}
    if attn_density < 1.0:
        katt = budget.allocate({l: f.attn_curve for l, f in fits.items()}, {l: f.heads for l, f in fits.items()},
                               attn_density)
    else:
        katt = {l: None for l in fits}  # every head
    return kmlp, katt


def build_entries(fits: dict[int, LayerFit], data: CalibrationData, options: Options, kmlp: dict[int, int],
                  katt: dict[int, int | None]) -> dict:
    """Plan entries from the fitted predictors and the chosen k (dense where k is the whole block;
    no attention entry for a layer whose attention block was not matched)."""
    entries = {}
    for l, f in fits.items():
        k, total, block = kmlp[l], f.neurons, data.mlp_blocks[l]
        stats = _stats(f.mlp_scores, f.mlp_importance, k)
        if k >= total:
            entries[(l, "mlp")] = PlanEntry(l, "mlp", total, total, stats=stats)
        else:
            entries[(l, "mlp")] = PlanEntry(l, "mlp", k, total, f.mlp_kind, f.mlp_tensors, block.activation,
                                            options.lookahead, stats=stats,
                                            values=options.values if block.gated else "exact")
        heads = f.heads or data.heads.get(l)
        ka = katt[l]
        if heads is None:
            continue
        if ka is None or ka >= heads:
            entries[(l, "attention")] = PlanEntry(l, "attention", heads, heads)
        else:
            head = predictors.head_kind().name
            entries[(l, "attention")] = PlanEntry(l, "attention", ka, heads, head, f.attn_tensors,
                                                  lookahead=options.lookahead and l > 0,
                                                  stats=_stats(f.attn_scores, f.attn_importance, ka))
    return entries


def record_settings(options: Options, mlp_blocks: dict, fits: dict[int, LayerFit], density: float, facts: dict,
                    seconds: float) -> dict:
    """The plan's record of how it was made."""
    first = min(fits)
    gated = mlp_blocks[first].gated
    return {"method": f"dejavu-glu-{options.predictor}" if gated else "dejavu-lowrank",
            "predictor": options.predictor, "values": options.values, "target_mlp_density": density,
            "attn_density": facts["attn_density"], "lookahead": options.lookahead, "rank": facts["rank"],
            "max_tokens": facts["max_tokens"], "seq_len": facts["seq_len"],
            "tokens_collected": facts["tokens_collected"],
            "min_density": facts["min_density"], "allocation": options.allocation, "seed": facts["seed"],
            "max_ppl_increase": facts["max_ppl_increase"], "predictor_cost": round(fits[first].predictor_cost, 4),
            "dense_when_unprofitable": facts["dense_when_unprofitable"], "collect_s": facts["collect_s"],
            "total_s": round(seconds, 1)}


def quality_record(dense_ppl: float, plan_ppl: float, holdout: list, seconds: float) -> dict:
    """What ``settings["quality"]`` holds: perplexity dense and under the plan on the held-out tokens."""
    return {"dense_ppl": round(dense_ppl, 4), "plan_ppl": round(plan_ppl, 4),
            "increase": round(plan_ppl / dense_ppl - 1.0, 5), "tokens": sum(c.numel() for c in holdout),
            "split": "calibration text, held out from collection", "seconds": round(seconds, 1)}


def check_quality(model, plan: SparsityPlan, data: CalibrationData, warn_ppl_increase: float | None,
                  progress: bool) -> None:
    """Measure `plan` on the held-out tokens (one dense and one masked-simulation pass), record it in
    ``plan.settings["quality"]``, and warn when the increase is above `warn_ppl_increase`."""
    from dejavu_compile.evaluation.perplexity import perplexity

    plan.settings["warn_ppl_increase"] = warn_ppl_increase
    if warn_ppl_increase is None or not data.holdout:
        plan.settings["quality"] = None
        plan.settings["quality_note"] = data.holdout_reason
        return
    t0 = time.time()
    dense_ppl = perplexity(model, data.holdout)
    plan_ppl = perplexity(model, data.holdout, plan)
    quality = plan.settings["quality"] = quality_record(dense_ppl, plan_ppl, data.holdout, time.time() - t0)
    if progress:
        print(f"held-out calibration tokens ({quality['tokens']}): perplexity {dense_ppl:.3f} dense, "
              f"{plan_ppl:.3f} with the plan ({quality['increase']:+.2%})")
    if quality["increase"] > warn_ppl_increase:
        warnings.warn(
            f"the calibrated plan raises perplexity by {quality['increase']:+.1%} on {quality['tokens']} held-out "
            f"calibration tokens ({dense_ppl:.3f} dense -> {plan_ppl:.3f}, MLP density {plan.mlp_density:.2f}), "
            f"above warn_ppl_increase={warn_ppl_increase:.0%}: its output may differ noticeably from the dense "
            f"model's. Raise mlp_density, or pass max_ppl_increase={warn_ppl_increase} to get the sparsest plan "
            "within that budget.", PlanQualityWarning, stacklevel=3)


def lowest_density_within_budget(model, holdout, build, max_ppl_increase: float, fingerprint, progress: bool):
    """The lowest MLP density on a 0.05 grid whose perplexity on the held-out calibration tokens stays
    within `max_ppl_increase` of the dense model's (the dense plan when none does); the chosen plan's
    measurement is its ``settings["quality"]``."""
    from dejavu_compile.evaluation.perplexity import perplexity

    if not holdout:
        raise ValueError("max_ppl_increase needs held-out calibration tokens, and the calibration text is a single "
                         "batch: pass more text (or a smaller seq_len)")
    t0 = time.time()
    base = perplexity(model, holdout)
    best = SparsityPlan.dense(model, {"method": "dense", "max_ppl_increase": max_ppl_increase})
    best.fingerprint = fingerprint
    best.settings["quality"] = quality_record(base, base, holdout, 0.0)
    for density in [round(1.0 - 0.05 * i, 2) for i in range(1, 15)]:
        plan = build(density)
        ppl = perplexity(model, holdout, plan)
        inc = ppl / base - 1.0
        if progress:
            print(f"density {density:.2f}: calibration-holdout perplexity {inc:+.2%}")
        if inc > max_ppl_increase:
            break
        plan.settings["holdout_ppl_increase"] = inc
        plan.settings["quality"] = quality_record(base, ppl, holdout, time.time() - t0)
        best = plan
    return best


def _stats(scores, importance, k: int) -> dict:
    return {"recall": recall(scores, importance, k), "mass": mass_captured(scores, importance, k),
            "oracle_mass": mass_captured(importance, importance, k)}


def _weight_rows(model, ref) -> torch.Tensor:
    return rules.weight_rows(model.get_parameter(ref.name), ref.layout, ref.rows).float()


def _split(n: int, frac: float = 0.8, seed: int = 0):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    cut = int(n * frac)
    return perm[:cut], perm[cut:]
