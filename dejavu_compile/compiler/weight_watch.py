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

:class:`StoredTensorCheck` covers what Dynamo's guards do check, for when a user drops them: every
compiled graph refuses model tensors of another dtype, shape or device than it was compiled for.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# Benchmarks switch the checks off to measure what they cost (benchmarks/weight_watch.py); nothing else should.
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


def stored_tensor_positions(gm, example_inputs) -> list[int]:
    """Positions of the graph inputs Dynamo read from a module's ``_parameters`` or ``_buffers``: the
    model's weights in whatever form they are stored (int8 values and scales are buffers)."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    positions = []
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", "")
        name = name() if callable(name) else name
        if isinstance(value, torch.Tensor) and ("._parameters[" in name or "._buffers[" in name):
            positions.append(i)
    return positions


class StoredTensorCheck:
    """Refuses a call whose model tensors are not of the dtype, shape and device the graph was
    compiled for.

    Dynamo's guards recompile when they change. With its guards on the modules dropped
    (``torch.compile(..., options={"guard_filter_fn": ...})``) nothing would: a model cast with
    ``.to(torch.bfloat16)`` after compiling, or another model of the same class compiled without
    ``isolate_recompiles=True``, would run a graph built for other tensors and fail deep in some op
    (a dtype mismatch in a matmul, a broadcast of the wrong sizes) with an error that names neither
    the cause nor the fix, or run on where no op checks. A sample of the stored tensors is checked
    (every ``len // samples``-th and the last: a cast or a model of another size changes all of
    them), about a microsecond per tensor.
    """

    def __init__(self, gm, example_inputs, samples: int = 8):
        stored = stored_tensor_positions(gm, example_inputs)
        step = max(1, len(stored) // samples)
        self.positions = sorted({*stored[::step], *stored[-1:]})
        self.signatures = [_signature(example_inputs[i]) for i in self.positions]

    def check(self, args) -> None:
        if not ENABLED:
            return
        for i, want in zip(self.positions, self.signatures):
            got = _signature(args[i])
            if got != want:
                raise RuntimeError(
                    f"dejavu: this graph was compiled for a model tensor of {_describe(want)} and is called with "
                    f"one of {_describe(got)}: the model changed after compiling (a dtype cast, another device) "
                    "or another model of the same class runs its graphs, which Dynamo's guards would have "
                    "caught had they been kept. Compile again (torch._dynamo.reset()), and with a guard_filter_fn "
                    "compile each model with isolate_recompiles=True")


def _signature(tensor: torch.Tensor) -> tuple:
    return tensor.dtype, tuple(tensor.shape), tensor.device


def _describe(signature: tuple) -> str:
    dtype, shape, device = signature
    return f"dtype {dtype}, shape {list(shape)}, device {device}"
