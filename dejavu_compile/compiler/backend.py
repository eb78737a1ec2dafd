"""The ``dejavu`` torch.compile backend.

``torch.compile(model, backend="dejavu", options={...})`` calls :data:`dejavu_backend` with Dynamo's
torch-level graph. The backend matches decoder blocks, applies the sparsity passes when a plan is
given, and hands the graph to Inductor (or runs it as is with ``inner="eager"``). Whatever goes
wrong in a pass, the model still runs: the backend logs why and compiles the untouched graph.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from dejavu_compile.errors import DejavuOptionError

log = logging.getLogger("dejavu_compile")

OPTION_DEFAULTS: dict[str, Any] = {
    "plan": None,  # a SparsityPlan; None compiles dense (matching only, for reports) unless mlp_density is set
    # without a plan: the training-free int8 plan built from the weights, keeping this share of each
    # gated MLP's neurons (passes/auto_plan.py)
    "mlp_density": None,
    "inner": "inductor",  # "inductor" or "eager": what runs the rewritten graph
    "inductor_config": None,  # dict of Inductor config patches
    "max_batch": 8,  # decode batches above this stay dense
    "on_report": None,  # callable(BackendReport) called after each graph is processed
    "strict": False,  # raise instead of falling back to the dense graph when a pass fails
    # CPU sparse MLPs: "native" (C++ ops, fp32), "op" (the custom op), "decomposed" (aten ops Inductor
    # fuses); "auto": native where the C++ ops build, else decomposed (op under inner="eager")
    "cpu_lowering": "auto",
    # force one kernel lowering for every sparse MLP, by its registry name (passes/lowering.py): "native",
    # "decomposed", "op" or "triton" (CUDA; on CPU tensors only under TRITON_INTERPRET=1 and inner="eager",
    # a test of the Triton kernels in a whole model); an error where it cannot run. None: cpu_lowering decides
    "lowering": None,
    "simulate": False,  # masked dense simulation of the plan (quality evaluation; any shape, not faster)
    # dense projections of CPU decode graphs: "auto" through the C++ GEMV op where it builds, sibling
    # projections (q, k, v; gate, up) in one call (passes/dense_linear.py); "unfused": one call per
    # projection; "aten": left to the inner compiler
    "dense_lowering": "auto",
    # SDPA of CPU decode graphs (at most 16 query rows): "auto" through the kernel table's decode
    # attention (the C++ op, passes/decode_attention.py: the cache read in place, its unused end not
    # visited, so a static cache longer than the sequence costs little), "aten": left to the inner compiler
    "attention_lowering": "auto",
}
INNER_CHOICES = ("inductor", "eager")


@dataclass
class BackendReport:
    """What the backend did with one graph."""

    graph_id: str
    match: Any = None  # passes.match.MatchResult
    rewritten: list[str] = field(default_factory=list)
    graph: Any = None  # the graph handed to the inner compiler
    dense_reason: str | None = None
    error: str | None = None
    extra_bytes: int = 0  # memory the compiled graph holds beyond the model's own: predictors, weight copies
    pass_counts: dict[str, int] = field(default_factory=dict)  # per pass run: what it did (passes/README.md)
    failed_pass: str | None = None  # the pass that raised, when one did
    plan: Any = None  # the plan applied: option plan, or the training-free one option mlp_density built


def validate_options(options: dict | None) -> dict:
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTION_DEFAULTS))
    if unknown:
        raise DejavuOptionError(f"unknown dejavu option(s) {', '.join(map(repr, unknown))}; "
                         f"valid options: {', '.join(sorted(OPTION_DEFAULTS))}")
    merged = {**OPTION_DEFAULTS, **options}
    if merged["inner"] not in INNER_CHOICES:
        raise DejavuOptionError(f"option 'inner' must be one of {INNER_CHOICES}, got {merged['inner']!r}")
    if merged["inductor_config"] is not None and not isinstance(merged["inductor_config"], dict):
        raise DejavuOptionError("option 'inductor_config' must be a dict of Inductor config patches")
    plan = merged["plan"]
    if plan is not None:
        from dejavu_compile.plan.sparsity_plan import SparsityPlan

        if not isinstance(plan, SparsityPlan):
            raise DejavuOptionError(f"option 'plan' must be a dejavu_compile.SparsityPlan, got {type(plan).__name__}")
    density = merged["mlp_density"]
    if density is not None:
        if plan is not None:
            raise DejavuOptionError("options 'plan' and 'mlp_density' exclude each other: a plan fixes each layer's "
                                    "density (calibrate(model, tokenizer, mlp_density=...)); mlp_density alone builds "
                                    "the training-free plan from the weights")
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
            raise DejavuOptionError(f"option 'mlp_density' must be a number in (0, 1], the share of each MLP's "
                                    f"neurons kept (e.g. 0.6), got {density!r}")
    from dejavu_compile.compiler.passes.lowering import cpu_lowering_names, registered_lowerings

    if merged["cpu_lowering"] not in cpu_lowering_names():
        raise DejavuOptionError(f"option 'cpu_lowering' must be one of {list(cpu_lowering_names())}, "
                                f"got {merged['cpu_lowering']!r}")
    if merged["lowering"] is not None:
        if merged["lowering"] not in registered_lowerings():
            raise DejavuOptionError(f"option 'lowering' must be None or one of {sorted(registered_lowerings())}, "
                                    f"got {merged['lowering']!r}")
    for name, choices in (("dense_lowering", ("auto", "unfused", "aten")), ("attention_lowering", ("auto", "aten"))):
        if merged[name] not in choices:
            raise DejavuOptionError(f"option {name!r} must be one of {list(choices)}, got {merged[name]!r}")
    max_batch = merged["max_batch"]
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise DejavuOptionError(f"option 'max_batch' must be a positive int, got {max_batch!r}")
    for name in ("simulate", "strict"):  # a truthy string such as "no" must not switch a mode on
        if not isinstance(merged[name], bool):
            raise DejavuOptionError(f"option {name!r} must be True or False, got {merged[name]!r}")
    if merged["on_report"] is not None and not callable(merged["on_report"]):
        raise DejavuOptionError(f"option 'on_report' must be a callable taking a BackendReport, "
                                f"got {merged['on_report']!r}")
    return merged


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy the passes may rewrite: Dynamo reads its own graph's placeholders after the backend."""
    graph = fx.Graph()
    value_map: dict = {}
    output = graph.graph_copy(gm.graph, value_map)
    graph.output(output)
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    for old, new in value_map.items():
        if hasattr(old, "_dynamo_source"):  # AOTAutograd maps inputs back to user code by these
            new._dynamo_source = old._dynamo_source
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source
    return copy


def _compile_inner(gm: fx.GraphModule, example_inputs, options: dict, mode: str | None, watch=None,
                   stored=None):
    """``watch``: a WeightWatch over the parameters the added tensors were derived from; ``stored``: a
    StoredTensorCheck of the model tensors' dtypes and shapes."""
    # tensors a pass added (predictor weights) follow the inputs Dynamo passes
    extra = tuple(gm.meta.get("dejavu_extra_inputs") or ())
    examples = [*example_inputs, *_static_examples(extra)] if extra else example_inputs
    compiled = _compile_inner_plain(gm, examples, options, mode)
    if stored is not None and not stored.positions:
        stored = None
    if watch is None and stored is None and not extra:
        return compiled

    def run_checked(*args):
        if stored is not None:
            stored.check(args)
        if watch is not None:
            watch.check(args)
        return compiled(*args, *extra)

    run_checked.weight_watch = watch
    return run_checked


def _static_examples(tensors) -> list:
    """The added tensors as fake tensors of fixed shape in Dynamo's fake mode. Handed over as real
    tensors, AOTAutograd fakeifies them with symbolic sizes when the graph is dynamic, and a guard
    Inductor then needs on those sizes (e.g. reshaping the int4 predictor's codes) has no source
    in user code: Dynamo fails building the guards (IndexError in produce_guards)."""
    fake_mode = torch._guards.detect_fake_mode()
    if fake_mode is None:
        return list(tensors)
    return [fake_mode.from_tensor(t, static_shapes=True) for t in tensors]


# Inductor settings for a graph the backend lowered to its C++ CPU ops (a CPU decode graph): a C++
# wrapper calls the kernels and ops one after another with no Python between them (what the Python
# wrapper costs a SmolLM2 step: benchmarks/profile_decode.py). The wrapper is built apart from the
# kernels, at a low optimisation level: built with them at -O3, a 30-layer decode graph takes
# minutes to compile. The option inductor_config overrides either setting.
CPU_DECODE_INDUCTOR_CONFIG = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}


def _compile_inner_plain(gm: fx.GraphModule, example_inputs, options: dict, mode: str | None):
    if options["inner"] == "eager":
        return gm.forward
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = dict(list_mode_options(mode) if mode else {})
    from dejavu_compile.compiler.passes.lowering import holds_cpp_wrapper_kernels

    if holds_cpp_wrapper_kernels(gm):
        patches.update(CPU_DECODE_INDUCTOR_CONFIG)
    patches.update(options["inductor_config"] or {})
    return compile_fx(gm, example_inputs, config_patches=patches or None)


class DejavuBackend:
    """One module-level instance (a fresh closure per call would force Dynamo recompiles)."""

    __name__ = "dejavu"

    def __call__(self, gm: fx.GraphModule, example_inputs, mode: str | None = None,
                 options: dict | None = None, **unexpected):
        if unexpected:
            raise DejavuOptionError(f"unexpected argument(s) {sorted(unexpected)} for the dejavu backend; "
                             "pass settings as options={...}")
        opts = validate_options(options)
        given = dict(opts)  # the passes replace opts["plan"] with the training-free one
        if mode not in (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
            raise DejavuOptionError(f"unknown mode {mode!r}")
        report = BackendReport(graph_id=str(gm.meta.get("dynamo_compile_id", "")))
        original = gm
        try:
            gm = self.run_passes(_copy_graph_module(gm), example_inputs, opts, report)
        except DejavuOptionError:  # the user's input is wrong (e.g. a plan for another model): say so
            raise
        except Exception as exc:  # the model must still run: dense graph, and say why
            if opts["strict"]:
                raise
            log.warning("dejavu: pass %s failed on graph %s, compiling it dense: %s: %s",
                        report.failed_pass or "?", report.graph_id, type(exc).__name__, exc)
            report.error = f"{type(exc).__name__}: {exc}"
            gm = original
        report.plan = opts["plan"]
        report.graph = gm
        report.extra_bytes = sum(t.numel() * t.element_size() for t in gm.meta.get("dejavu_extra_inputs", ()))
        if opts["on_report"] is not None:
            opts["on_report"](report)
        watch = None
        if gm is not original and gm.meta.get("dejavu_extra_inputs"):
            watch = self._weight_watch(original, example_inputs, given, gm.meta["dejavu_extra_inputs"])
        from dejavu_compile.compiler.weight_watch import StoredTensorCheck

        return _compile_inner(gm, example_inputs, opts, mode, watch, StoredTensorCheck(original, example_inputs))

    def _weight_watch(self, original: fx.GraphModule, example_inputs, given: dict, derived: list):
        """A WeightWatch that derives this graph's added tensors again by rerunning the passes on
        the untouched graph with the current weights (the weights check included, so a calibrated
        plan that no longer fits raises)."""
        from dejavu_compile.compiler.weight_watch import WeightWatch, parameter_positions

        grad_enabled = torch.is_grad_enabled()

        def derive(args):
            report = BackendReport(graph_id=f"{original.meta.get('dynamo_compile_id', '')} (weights changed)")
            with torch.set_grad_enabled(grad_enabled):
                gm = self.run_passes(_copy_graph_module(original), args, dict(given), report)
            return list(gm.meta.get("dejavu_extra_inputs", ()))

        return WeightWatch(example_inputs, parameter_positions(example_inputs), derived, derive)

    def run_passes(self, gm, example_inputs, opts, report: BackendReport) -> fx.GraphModule:
        """The sparsity passes (``passes/sparsify.py``) over ``gm``, in order (``passes/runner.py``),
        then the decode lowering of what stays dense, whether or not the graph was made sparse."""
        from dejavu_compile.compiler.passes.runner import PassContext, run_passes
        from dejavu_compile.compiler.passes.sparsify import decode_lowering_passes, default_passes

        gm = run_passes(gm, default_passes(opts), PassContext(list(example_inputs), opts, report))
        return run_passes(gm, decode_lowering_passes(opts), PassContext(list(example_inputs), opts, report))


dejavu_backend = DejavuBackend()
