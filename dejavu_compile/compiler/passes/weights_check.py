"""Pass ``weights_check``: the plan was calibrated on the weights this graph computes with.

A plan of another checkpoint of the same architecture passes ``plan_check`` (every shape fits),
and with ``values="predictor"`` its int8 copy of gate/up would silently replace this model's MLPs.
The plan's fingerprint holds a weight sample (``plan.sparsity_plan.weight_sample``); the graph's
parameter placeholders carry the real parameters, so the sample is compared with them (a dtype cast
of the same weights passes). Verdicts are cached per plan and parameter tensor (and its version),
so recompiles and the other graphs of a model read no weight twice.
"""
from __future__ import annotations

import logging
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from dejavu_compile.compiler.passes.graph_utils import param_name
from dejavu_compile.errors import PlanMismatchError
from dejavu_compile.plan.sparsity_plan import describe_weight_differences, same_weights, sample_name

log = logging.getLogger("dejavu_compile")

# plan -> {parameter tensor -> (state, sample name, same weights)}; weak on both, so nothing is kept alive
_verdicts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_unverifiable_logged: weakref.WeakSet = weakref.WeakSet()


def _state(tensor: torch.Tensor) -> tuple:
    """Changes when the tensor's values may have: in-place updates bump the version, ``.data =``
    (a dtype cast, prepare_model) swaps the storage."""
    return tensor._version, tensor.data_ptr(), tensor.dtype, tuple(tensor.stride())


def weight_differences(plan, named_tensors) -> tuple[list[str], int]:
    """(parameters whose values differ from the plan's weight sample, parameters compared), with
    cached verdicts. The plan must have a sample."""
    sample = plan.weight_sample
    per_plan = _verdicts.get(plan)
    if per_plan is None:
        per_plan = _verdicts[plan] = WeakIdKeyDictionary()
    differ, compared = [], 0
    for name, tensor in named_tensors:
        state = _state(tensor)
        cached = per_plan.get(tensor)
        if cached is None or cached[0] != state:
            key = sample_name(sample, name)
            cached = (state, key, key is None or same_weights(sample, key, tensor))
            per_plan[tensor] = cached
        _, key, same = cached
        if key is None:
            continue
        compared += 1
        if not same:
            differ.append(key)
    return differ, compared


class WeightsCheck:
    """Raises :class:`PlanMismatchError` naming the parameters whose values differ from the plan's
    weight sample. A plan without a sample (a file of format 1 or 2) is logged once as unverifiable;
    the training-free plan (option ``mlp_density``) is built from these weights and not checked.
    Counts the parameters compared."""

    name = "weights_check"

    def __call__(self, gm, ctx):
        plan = ctx.plan
        if plan is None or ctx.opts.get("mlp_density") is not None:
            return gm
        if plan.weight_sample is None:
            if plan not in _unverifiable_logged:
                _unverifiable_logged.add(plan)
                origin = (f"plan format {plan.format_version}, saved by an older dejavu-compile"
                          if plan.format_version < 3 else "a plan built without model_fingerprint(model)")
                log.warning("dejavu: this sparsity plan has no weight sample (%s), so the backend cannot verify "
                            "it was calibrated on this model's weights; recalibrate to bind it to them", origin)
            ctx.count(self.name, 0)
            return gm
        params = [(name, value) for node, value in ctx.values(gm).items()
                  if isinstance(value, torch.Tensor) and (name := param_name(node)) is not None]
        differ, compared = weight_differences(plan, params)
        if differ:
            raise PlanMismatchError("sparsity plan does not fit this model: "
                                    + describe_weight_differences(differ, compared))
        ctx.count(self.name, compared)
        return gm
