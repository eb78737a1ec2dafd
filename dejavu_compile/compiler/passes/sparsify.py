"""The backend's pass lists, in the order the runner applies them (``runner.py``; see README.md)."""
from __future__ import annotations

from dejavu_compile.compiler.passes.auto_plan import TrainingFreePlan
from dejavu_compile.compiler.passes.decode_attention import DecodeAttentionPass
from dejavu_compile.compiler.passes.dense_linear import DenseLinearPass
from dejavu_compile.compiler.passes.guards import DecodeShapeGuard, PlanCheck, TrainingGuard
from dejavu_compile.compiler.passes.head_screen import HeadScreenPass
from dejavu_compile.compiler.passes.match import MatchPass
from dejavu_compile.compiler.passes.simulate import SimulationPass
from dejavu_compile.compiler.passes.sparse_attention import SparseAttentionPass
from dejavu_compile.compiler.passes.sparse_mlp import SparseMLPPass
from dejavu_compile.compiler.passes.weights_check import WeightsCheck


def default_passes(opts: dict) -> list:
    """match -> training_guard -> auto_plan -> plan_check -> weights_check
    -> (simulate | decode_shape -> sparse_mlp -> sparse_attention -> head_screen)."""
    passes = [MatchPass(), TrainingGuard(), TrainingFreePlan(), PlanCheck(), WeightsCheck()]
    if opts.get("simulate"):
        return [*passes, SimulationPass()]
    return [*passes, DecodeShapeGuard(), SparseMLPPass(), SparseAttentionPass(), HeadScreenPass()]


def decode_lowering_passes(opts: dict) -> list:
    """dense_linear, decode_attention: after the sparsity passes, whether they ran to the end or
    stopped (no plan, prefill), the projections left dense go through the GEMV kernel and the
    attention left dense through the decode attention kernel, at decode shapes."""
    return [DenseLinearPass(), DecodeAttentionPass()]
