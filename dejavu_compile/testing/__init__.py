"""Helpers for users' CI: check that the dejavu-compiled model computes what eager computes.

    from dejavu_compile.testing import assert_matches_eager
    assert_matches_eager(model, input_ids)                               # logits
    assert_matches_eager(model.generate, input_ids, max_new_tokens=16)   # generated tokens

A pytest fixture is available with ``pytest_plugins = ["dejavu_compile.testing.pytest_plugin"]``.
"""
from __future__ import annotations

import inspect

import torch

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


def describe_difference(name: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> str | None:
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


def run_compiled_and_eager(fn, *args, dejavu_options: dict | None = None, **kwargs):
    """(compiled output, eager output) of ``fn(*args, **kwargs)``; ``fn`` is a module or ``model.generate``."""
    options = dict(dejavu_options or {})
    with torch.no_grad():
        if _is_generate(fn):
            model = fn.__self__
            expected = fn(*args, **kwargs)
            original = model.forward
            model.forward = torch.compile(original, backend="dejavu", options=options)
            try:
                actual = fn(*args, **kwargs)
            finally:
                model.forward = original
        else:
            expected = fn(*args, **kwargs)
            actual = torch.compile(fn, backend="dejavu", options=options)(*args, **kwargs)
    return actual, expected


def assert_matches_eager(model, *args, rtol: float | None = None, atol: float | None = None,
                         dejavu_options: dict | None = None, **kwargs) -> None:
    """Compile ``model`` with the dejavu backend and assert it matches eager.

    ``model`` is a module (its outputs' logits are compared within tolerances chosen by dtype unless
    ``rtol``/``atol`` are given) or a bound ``model.generate`` (generated tokens must be identical).
    ``dejavu_options`` are the backend's ``options``; other keyword arguments go to the model.
    """
    actual, expected = run_compiled_and_eager(model, *args, dejavu_options=dejavu_options, **kwargs)
    got, want = _tensors_of(actual), _tensors_of(expected)
    if set(got) != set(want) or not want:
        raise AssertionError(f"compiled and eager outputs differ in structure: {sorted(got)} vs {sorted(want)}")
    problems = []
    for name, expected_tensor in want.items():
        d_rtol, d_atol = default_tolerance(expected_tensor.dtype)
        problem = describe_difference(name, got[name], expected_tensor,
                                      d_rtol if rtol is None else rtol, d_atol if atol is None else atol)
        if problem:
            problems.append(problem)
    if problems:
        raise AssertionError("dejavu-compiled model does not match eager:\n" + "\n".join(problems))
