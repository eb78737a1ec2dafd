import os
import pathlib

import torch

# Without a GPU, Triton kernels run on CPU tensors only in interpreter mode, which must be chosen
# before any kernel module is imported. With one, they run compiled, with fixed launch configs
# (autotuning every Hypothesis shape would take minutes; tests/test_gpu.py covers autotune).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DEJAVU_TRITON_AUTOTUNE", "0")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      str(pathlib.Path(__file__).resolve().parent.parent / ".cache" / "inductor"))

import pytest

pytest_plugins = ["dejavu_compile.testing.pytest_plugin"]

# Two cores under load: multi-threaded small matmuls can stall.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from a clean Dynamo state, so graph counts and recompiles are its own."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def poison(monkeypatch):
    """Every internal buffer starts as NaN: a kernel that leaves part of one unwritten fails."""
    from dejavu_compile.kernels import _common

    monkeypatch.setattr(_common, "POISON_BUFFERS", True)
