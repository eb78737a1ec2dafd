"""The errors the package raises on purpose: bad options, and plans that do not fit a model."""
from __future__ import annotations

try:  # Dynamo re-raises ShortenTraceback as is, so the user sees our ValueError, not a wrapper.
    from torch._dynamo.exc import ShortenTraceback as _PassThrough
except ImportError:  # pragma: no cover - older torch
    _PassThrough = None

if _PassThrough is not None:
    class DejavuOptionError(ValueError, _PassThrough):
        """Bad backend options or arguments (a ValueError that reaches the torch.compile caller)."""

        def __init__(self, message: str):
            _PassThrough.__init__(self, message, first_useful_frame=None)
else:  # pragma: no cover
    class DejavuOptionError(ValueError):
        """Bad backend options or arguments."""


class PlanMismatchError(DejavuOptionError):
    """The plan was made for another model (or another shape of this one)."""
