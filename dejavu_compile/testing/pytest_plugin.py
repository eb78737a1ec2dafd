"""pytest plugin: ``pytest_plugins = ["dejavu_compile.testing.pytest_plugin"]`` in a conftest.py.

Gives the fixture ``dejavu_equivalence``: :func:`dejavu_compile.testing.assert_matches_eager`, which
compiles on a code object of its own and drops its graphs afterwards, so one test's compiled graphs
neither leak into the next nor hide behind the caller's.
"""
import pytest

from dejavu_compile.testing import assert_matches_eager


@pytest.fixture
def dejavu_equivalence():
    return assert_matches_eager
