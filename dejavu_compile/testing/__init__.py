"""Helpers for users' CI: check that the dejavu-compiled model computes what eager computes.

    from dejavu_compile.testing import assert_matches_eager
    assert_matches_eager(model, input_ids)                               # prefill and decode-step logits
    assert_matches_eager(model.generate, input_ids, max_new_tokens=16)   # generated tokens
    assert_matches_eager(model, input_ids, dejavu_options={"plan": plan}, rtol=0.05, atol=0.5)  # sparse

Each check compiles on a code object of its own, dropped afterwards: the caller's compiled
functions and Dynamo's recompile limit on the model's code neither help nor hide it. It counts the
compiled graphs that ran, so a silent fallback to eager fails the check instead of comparing eager
with eager. A Hugging Face causal LM is compared on decode steps over a static cache as well as on
the call itself (the backend makes only decode steps sparse). Options that change values by design
(a sparse plan, ``mlp_density``) need an explicit ``rtol``/``atol``, and fail if no graph was made sparse.

A pytest fixture is available with ``pytest_plugins = ["dejavu_compile.testing.pytest_plugin"]``.
"""
from __future__ import annotations

import functools
import inspect

import torch

from dejavu_compile.compiler.isolated import own_code

# passes whose work changes values by design (their pass_counts > 0 on a report: the graph is sparse)
SPARSE_PASSES = ("sparse_mlp", "sparse_attention", "head_screen", "simulate")

# (rtol, atol) per dtype: fp32 graph rewrites and Inductor fusions reorder float sums.
DEFAULT_TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (3e-2, 3e-2),
}


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return DEFAULT_TOLERANCES.get(dtype, (1e-4, 1e-4))


def _tensors_of(output) -> dict[str, torch.Tensor]:
    """The tensors worth comparing: logits if the output has them, else every tensor field."""
    if isinstance(output, torch.Tensor):
        return {"output": output}
    if hasattr(output, "keys") and hasattr(output, "__getitem__"):
        if "logits" in output.keys():
            return {"logits": output["logits"]}
        if "sequences" in output.keys():
            return {"sequences": output["sequences"]}
        return {k: v for k, v in ((k, output[k]) for k in output.keys()) if isinstance(v, torch.Tensor)}
    if isinstance(output, (tuple, list)):
        found = {}
        for i, item in enumerate(output):
            found.update({f"[{i}]{'' if k == 'output' else '.' + k}": v for k, v in _tensors_of(item).items()})
        return found
    return {}


def describe_difference(name: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float,
                        atol: float) -> str | None:
    """None when ``actual`` matches ``expected``; else a readable account of where and by how much."""
    if actual.shape != expected.shape:
        return f"{name}: shape {tuple(actual.shape)} (compiled) != {tuple(expected.shape)} (eager)"
    if not actual.is_floating_point():
        differ = (actual != expected).nonzero()
        if differ.numel() == 0:
            return None
        first = tuple(differ[0].tolist())
        return (f"{name}: {differ.shape[0]} of {actual.numel()} values differ; first at {first}: "
                f"compiled {actual[first].item()} vs eager {expected[first].item()}\n"
                f"  compiled: {actual.flatten()[:32].tolist()}\n  eager:    {expected.flatten()[:32].tolist()}")
    a, e = actual.double(), expected.double()
    bad = ~torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=False)
    if not bad.any():
        return None
    err = (a - e).abs()
    where = tuple(torch.nonzero(err == err.max())[0].tolist()) if torch.isfinite(err).all() else \
        tuple(torch.nonzero(~torch.isfinite(a))[0].tolist())
    return (f"{name}: {int(bad.sum())} of {a.numel()} elements outside rtol={rtol}, atol={atol}; "
            f"max abs diff {err.max().item():.3e} at {where} (compiled {a[where].item():.6g}, "
            f"eager {e[where].item():.6g}); max rel diff {(err / e.abs().clamp_min(1e-12)).max().item():.3e}")


def _is_generate(fn) -> bool:
    return inspect.ismethod(fn) and fn.__name__ == "generate" and isinstance(fn.__self__, torch.nn.Module)


def changes_values(options: dict) -> bool:
    """Whether these backend options make the model sparse (its outputs then differ by design)."""
    plan = options.get("plan")
    density = options.get("mlp_density")
    if density is not None:
        return not (isinstance(density, (int, float)) and density >= 1)  # 1.0 keeps every neuron
    return plan is not None and (any(not e.dense for e in plan.entries.values()) or plan.head_candidates > 0)


class _CountingBackend:
    """The dejavu backend, counting the graphs it compiled, the compiled calls that ran and the
    reports (the caller's ``on_report`` still gets each)."""

    def __init__(self, options: dict):
        self.options = dict(options)
        self.graphs = 0
        self.calls = 0
        self.reports = []

    def __call__(self, gm, example_inputs, **kwargs):
        from dejavu_compile.compiler.backend import dejavu_backend

        user_on_report = self.options.get("on_report")

        def on_report(report):
            self.reports.append(report)
            if user_on_report is not None:
                user_on_report(report)

        compiled = dejavu_backend(gm, example_inputs, mode=kwargs.get("mode"),
                                  options={**self.options, "on_report": on_report})
        self.graphs += 1

        def run(*args):
            self.calls += 1
            return compiled(*args)

        return run

    def sparse_graphs(self) -> int:
        return sum(1 for r in self.reports if any(r.pass_counts.get(p, 0) > 0 for p in SPARSE_PASSES))

    def dense_reasons(self) -> str:
        reasons = sorted({r.error or r.dense_reason or "no sparse block" for r in self.reports})
        return "; ".join(reasons) or "no graph compiled"


class _IsolatedCompile:
    """``fn`` compiled with a :class:`_CountingBackend` on a fresh code object, dropped on exit."""

    def __init__(self, fn, options: dict, name: str = "dejavu_matches_eager"):
        self.backend = _CountingBackend(options)
        self.call = own_code(lambda *args, **kwargs: fn(*args, **kwargs), name)
        functools.update_wrapper(self.call, fn)  # generate() reads forward's signature
        self.compiled = torch.compile(self.call, backend=self.backend)

    def __call__(self, *args, **kwargs):
        before = self.backend.calls
        out = self.compiled(*args, **kwargs)
        if self.backend.calls == before:
            raise AssertionError("the dejavu-compiled function ran no compiled graph: Dynamo ran it eagerly (a "
                                 "recompile limit or a suppressed error), so nothing compiled was compared")
        return out

    def close(self):
        torch._dynamo.reset_code(self.call.__code__)


def greedy_generate(model, ids, new_tokens: int = 16, cache: str = "dynamic",
                    dejavu_options: dict | None = None) -> torch.Tensor:
    """Greedy tokens from ``model.generate``; with ``dejavu_options`` its forward is compiled with
    the dejavu backend for this call. ``cache`` is "dynamic" (DynamicCache) or "static"."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    original = model.forward
    if dejavu_options is not None:
        model.forward = torch.compile(original, backend="dejavu", options=dejavu_options)
    try:
        with torch.no_grad():
            return model.generate(ids, **kwargs)
    finally:
        model.forward = original


def _is_causal_lm(model, args, kwargs) -> bool:
    ids = args[0] if args else kwargs.get("input_ids")
    return (isinstance(model, torch.nn.Module) and hasattr(model, "config") and hasattr(model, "generate")
            and isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point())


def _decode_logits(fn, model, ids, tokens, steps: int):
    """Logits of a prefill of ``ids`` and of ``steps`` decode steps feeding ``tokens`` (or, when
    None, the greedy ones), over a static cache: [prefill last row, step 1, ...] and the tokens fed."""
    from transformers import StaticCache

    from dejavu_compile.evaluation.decode import cache_keyword

    prompt, keyword = ids.shape[1], cache_keyword(model)
    cache = StaticCache(config=model.config, max_cache_len=prompt + steps)
    logits = fn(input_ids=ids, **{keyword: cache}, use_cache=True,
                cache_position=torch.arange(prompt, device=ids.device)).logits
    rows, fed = [logits[:, -1]], []
    for step in range(steps):
        token = rows[-1].argmax(-1, keepdim=True) if tokens is None else tokens[step]
        fed.append(token)
        position = torch.tensor([prompt + step], device=ids.device)
        rows.append(fn(input_ids=token, **{keyword: cache}, use_cache=True, cache_position=position).logits[:, -1])
    return rows, fed


def run_compiled_and_eager(fn, *args, dejavu_options: dict | None = None, decode_steps: int = 4, **kwargs):
    """([(name, compiled output, eager output)], the counting backend) for ``fn(*args, **kwargs)``;
    ``fn`` is a module, a callable or a bound ``model.generate``."""
    options = dict(dejavu_options or {})
    pairs = []
    with torch.no_grad():
        if _is_generate(fn):
            model = fn.__self__
            expected = fn(*args, **kwargs)
            original = model.forward
            compiled = _IsolatedCompile(original, options)
            model.forward = compiled
            try:
                actual = fn(*args, **kwargs)
            finally:
                model.forward = original
                compiled.close()
            return [("", actual, expected)], compiled.backend
        compiled = _IsolatedCompile(fn, options)
        try:
            pairs.append(("", compiled(*args, **kwargs), fn(*args, **kwargs)))
            if decode_steps > 0 and _is_causal_lm(fn, args, kwargs):
                ids = args[0] if args else kwargs["input_ids"]
                try:
                    want, fed = _decode_logits(fn, fn, ids, None, decode_steps)
                except Exception as err:
                    raise ValueError(f"the model does not decode over a static cache ({type(err).__name__}: {err}); "
                                     "pass decode_steps=0 to compare the call alone") from err
                got, _ = _decode_logits(compiled, fn, ids, fed, decode_steps)
                pairs += [(f"decode step {i} " if i else "prefill (static cache) ", {"logits": g}, {"logits": w})
                          for i, (g, w) in enumerate(zip(got, want))]
        finally:
            compiled.close()
    return pairs, compiled.backend


def assert_matches_eager(model, *args, rtol: float | None = None, atol: float | None = None,
                         dejavu_options: dict | None = None, decode_steps: int = 4, **kwargs) -> None:
    """Compile ``model`` with the dejavu backend and assert it matches eager.

    ``model`` is a module or callable (its outputs' logits are compared, within tolerances chosen
    by dtype unless ``rtol``/``atol`` are given) or a bound ``model.generate`` (generated tokens
    must be identical). A Hugging Face causal LM called with token ids is also run for
    ``decode_steps`` decode steps over a static cache (eager's greedy tokens fed to both), and each
    step's logits compared: decode steps are what a plan makes sparse. ``dejavu_options`` are the
    backend's ``options``; options that make the model sparse need ``rtol`` and ``atol`` (the
    difference a plan may make is the caller's to state) and fail unless a graph was made sparse.
    Other keyword arguments go to the model.
    """
    options = dict(dejavu_options or {})
    sparse = changes_values(options)
    if sparse and not _is_generate(model) and (rtol is None or atol is None):
        raise ValueError("dejavu_options make the model sparse, which changes its logits by design; pass rtol= and "
                         "atol= for the difference you accept (the plan's quality is calibrate()'s held-out check), "
                         "or compare greedy tokens with assert_matches_eager(model.generate, ...)")
    pairs, backend = run_compiled_and_eager(model, *args, dejavu_options=options, decode_steps=decode_steps, **kwargs)
    if backend.graphs == 0:
        raise AssertionError("the dejavu backend compiled no graph: nothing compiled was compared")
    if sparse and backend.sparse_graphs() == 0:
        raise AssertionError(f"dejavu_options ask for sparsity but no compiled graph was made sparse "
                             f"({backend.dense_reasons()}): the comparison did not test the sparse path")
    problems = []
    for prefix, actual, expected in pairs:
        got, want = _tensors_of(actual), _tensors_of(expected)
        if set(got) != set(want) or not want:
            raise AssertionError(f"compiled and eager outputs differ in structure: {sorted(got)} vs {sorted(want)}")
        for name, expected_tensor in want.items():
            d_rtol, d_atol = default_tolerance(expected_tensor.dtype)
            problem = describe_difference(prefix + name, got[name], expected_tensor,
                                          d_rtol if rtol is None else rtol, d_atol if atol is None else atol)
            if problem:
                problems.append(problem)
    if problems:
        raise AssertionError("dejavu-compiled model does not match eager:\n" + "\n".join(problems))
