"""torch.compile for the library's own traces (explain, calibration, perplexity), kept apart from
the user's compiled functions.

Dynamo keeps compiled graphs on the code object it traced. Compiling ``model`` directly would put
the library's graphs on the model's ``forward`` code, shared with every compile of the model (and
its recompile limit), and cleaning up would need a global ``torch._dynamo.reset()``, which throws
away the user's compiled functions. A wrapper with a code object of its own avoids both: its
graphs are dropped with ``torch._dynamo.reset_code`` when the block ends.
"""
from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator

import torch


def own_code(fn: Callable, name: str) -> types.FunctionType:
    """``fn`` (a plain function or lambda) with a fresh code object: a lambda defined in a function
    has one code object for all its calls, so its Dynamo cache would be shared between them."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__,
                              fn.__closure__)


@contextlib.contextmanager
def isolated_compile(model, name: str, **compile_kwargs) -> Iterator[Callable]:
    """``torch.compile`` of ``model(*args, **kwargs)`` whose graphs live and die with this block."""
    call = own_code(lambda *args, **kwargs: model(*args, **kwargs), name)
    try:
        yield torch.compile(call, **compile_kwargs)
    finally:
        torch._dynamo.reset_code(call.__code__)
