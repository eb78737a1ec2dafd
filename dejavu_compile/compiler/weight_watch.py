"""Compiled graphs that notice their weights changed.

A graph the backend rewrote holds tensors it derived from the model's parameters at compile time
(int8 gate/up copies of the training-free plan, bf16 down rows, transposed copies, the screened
head's int8 copy) and, with a calibrated plan, the promise that the parameters are the ones the
plan was calibrated on. Dynamo guards a parameter's shape, dtype and strides, not its values:
``model.load_state_dict(other)`` or an in-place edit changes none of them, so nothing recompiles.

:class:`WeightWatch` keeps each parameter input's version counter and storage address and, on every
call, compares them (a few hundred attribute reads per step; ``benchmarks/weight_watch.py``
measures the cost). When one changed, the graph's derived tensors are derived again from the
current weights by the same passes that built them, and copied into the tensors the compiled code
reads (their addresses stay, so CUDA graphs stay valid). A calibrated plan whose weight sample no
longer matches raises :class:`~dejavu_compile.errors.PlanMismatchError` from that call instead.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# Benchmarks switch the check off to measure what it costs (benchmarks/weight_watch.py); nothing else should.
ENABLED = True


def _state(tensor: torch.Tensor) -> tuple:
    """Changes when the tensor's values may have: in-place writes bump the version (inference
    tensors have none), ``.data =`` or a new Parameter moves the storage."""
    return (None if tensor.is_inference() else tensor._version), tensor.data_ptr()


class WeightWatch:
    """Watches the parameter inputs at ``positions`` of a compiled graph's arguments.

    ``derive(args)`` returns the graph's derived tensors computed from ``args`` (the backend reruns
    its passes); they replace the values of ``derived`` in place.
    """

    def __init__(self, args: Sequence, positions: list[int], derived: list[torch.Tensor],
                 derive: Callable[[list], list[torch.Tensor]]):
        self.positions = positions
        self.derived = derived
        self.derive = derive
        self.states = self._states(args)
        self.rederived = 0  # how many times the weights changed and the tensors were derived again

    def _states(self, args) -> list[tuple]:
        return [_state(args[i]) for i in self.positions]

    def check(self, args) -> None:
        """Derive again if a watched parameter changed since the last check."""
        if not ENABLED:
            return
        states = self._states(args)
        if states == self.states:
            return
        fresh = self.derive(list(args))
        if len(fresh) != len(self.derived) or any(
                (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device) for a, b in zip(fresh, self.derived)):
            raise RuntimeError("dejavu: the model's weights changed after compiling and the graph built from "
                               "them no longer fits them; compile the model again (torch._dynamo.reset())")
        with torch.no_grad():
            for old, new in zip(self.derived, fresh):
                if new is not old:
                    old.copy_(new)
        self.states = states
        self.rederived += 1


def parameter_positions(example_inputs) -> list[int]:
    """Positions of the graph inputs that are the model's parameters (what derived tensors come
    from); buffers are left out: some models write theirs on every call."""
    return [i for i, value in enumerate(example_inputs) if isinstance(value, torch.nn.Parameter)]
