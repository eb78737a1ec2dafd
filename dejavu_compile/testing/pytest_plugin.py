"""pytest plugin: ``pytest_plugins = ["dejavu_compile.testing.pytest_plugin"]`` in a conftest.py.

Gives the fixture ``dejavu_equivalence``, :func:`dejavu_compile.testing.assert_matches_eager` with
Dynamo state reset before each use, so one test's compiled graphs do not leak into the next.
"""
import pytest
import torch

from dejavu_compile.testing import assert_matches_eager


@pytest.fixture
def dejavu_equivalence():
    def check(model, *args, **kwargs):
        torch._dynamo.reset()
        assert_matches_eager(model, *args, **kwargs)

    yield check
    torch._dynamo.reset()
