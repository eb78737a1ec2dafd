"""Predictor kinds: the table (`registry`) and one module per kind.

    twolayer, twolayer_relu   Deja Vu's trained two-layer predictor (plain MLPs, attention heads)
    glu_lowrank               rank-r copy of a gated MLP's gate and up, fitted in closed form
    glu_int8                  the gated MLP's own gate/up rows in int8
    glu_int4                  a 4-bit copy of gate/up fitted to the calibration activations

`metrics` scores selections (recall, captured mass); `baselines` holds the training-free selectors
they are compared with.
"""
from dejavu_compile.plan.predictors import glu_int4, glu_int8, glu_lowrank, twolayer
from dejavu_compile.plan.predictors.registry import (
    FitInputs,
    PredictorKind,
    auto_option,
    get,
    head_kind,
    names,
    option_kinds,
    option_names,
    register,
    training_free_kind,
    unregister,
    v1_kind,
)

__all__ = ["FitInputs", "PredictorKind", "auto_option", "get", "head_kind", "names", "option_kinds", "option_names",
           "register", "training_free_kind", "unregister", "v1_kind", "glu_int4", "glu_int8", "glu_lowrank", "twolayer"]
