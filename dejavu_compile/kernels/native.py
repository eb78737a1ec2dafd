"""The CPU sparse MLP kernel in C (``cpu_sparse_mlp.c``), built on first use and called via ctypes.

Why C: the op's torch path is an Inductor-generated gather-GEMV loop over the gate and up rows, a
second op (embedding_bag) over the down rows, and a nested compiled call; on short rows (SmolLM2:
2.3 KB) every row start waits on DRAM. One C loop that reads a neuron's three rows back to back,
with a short software prefetch, makes the op 1.4x / 1.9x / 1.2x faster on SmolLM2 shapes at
25 / 50 / 75% density (efficiency 0.40 / 0.58 / 0.68 against 0.24 / 0.31 / 0.44) and 0.99-1.14x
as fast on LLaMA-7B's (efficiency 0.51-0.81 against 0.46-0.80), per call, overhead included (``python benchmarks/kernels.py --threads 2``). Torch
offers no op that does this, so we compile 100 lines. Inside a compiled decode graph the backend
still lowers CPU MLPs to Inductor-fused ops by default: measured there, they are as fast
(``passes/sparsify.py``, ``_use_decomposed``).

Build: the C compiler Inductor uses on CPU anyway (``$CC``, else ``cc``/``gcc``), flags
``-O3 -march=native -fopenmp``; the library is cached under ``$DEJAVU_CACHE/kernels`` keyed by the
source, flags, compiler and CPU, so a home directory shared between machines is safe. When no
compiler works (or ``DEJAVU_CPU_NATIVE=0``), :func:`available` is False, a warning says why once,
and the callers keep their torch/Inductor path. fp32 only: other dtypes take the torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from . import _common as C

SOURCE = Path(__file__).with_name("cpu_sparse_mlp.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}
# Prefetch the first PREFETCH_BYTES of each row PREFETCH_ROWS neurons ahead (benchmarks/kernels.py
# --prefetch-sweep, LLaMA-7B rows at 25% density: efficiency 0.74 without, 0.77-0.81 with 64-1024 B
# 2-8 neurons ahead, 0.71 prefetching whole rows; at 50% and on SmolLM2 within the noise, +-0.04).
PREFETCH_ROWS = 4
PREFETCH_BYTES = 256

_STATE: dict = {"lib": None, "error": None, "enabled": os.environ.get("DEJAVU_CPU_NATIVE", "1") != "0"}
_LOCK = threading.Lock()


def _cpu_key() -> str:
    """What -march=native depends on: the CPU model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() + platform.machine()


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_key()]).encode())
    from dejavu_compile.models import cache_dir

    folder = cache_dir() / "kernels"
    target = folder / f"cpu_sparse_mlp-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        result = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                                timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load():
    if _STATE["lib"] is not None or _STATE["error"] is not None or not _STATE["enabled"]:
        return _STATE["lib"]
    with _LOCK:
        if _STATE["lib"] is None and _STATE["error"] is None:
            try:
                cc = _compiler()
                if cc is None:
                    raise RuntimeError("no C compiler found (set $CC)")
                lib = ctypes.CDLL(str(_build(cc)))
                fn = lib.dejavu_sparse_mlp_f32
                P, I = ctypes.c_void_p, ctypes.c_int64
                fn.argtypes = [P, I, I, I, P, I, P, I, P, I, P, P, P, P, I, I, ctypes.c_int, P, P,
                               ctypes.c_int, I, I]
                fn.restype = None
                _STATE["lib"] = fn
            except Exception as err:  # no compiler, no OpenMP, a read-only cache: keep the torch path
                _STATE["error"] = f"{type(err).__name__}: {err}"
                warnings.warn(f"dejavu: the C sparse MLP kernel is unavailable ({_STATE['error']}); "
                              "CPU sparse MLPs use the slower torch/Inductor path", RuntimeWarning, stacklevel=3)
    return _STATE["lib"]


def available() -> bool:
    """True when the C kernel is built (or can be built now) and enabled."""
    return _load() is not None


def applies(x: Tensor, weights: list[Optional[Tensor]], idx: Tensor) -> bool:
    """Whether the C kernel can run this call: fp32 on CPU, rows with unit stride, x and idx
    contiguous along their last dim. Cheap metadata checks (builds the kernel on first use)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not _STATE["enabled"]:
        return False
    for w in weights:
        if w is not None and (w.stride(-1) != 1 or (w.dim() == 1 and not w.is_contiguous())):
            return False
    if idx.stride(-1) != 1:
        return False
    return available()


def sparse_mlp_f32(x: Tensor, w_a: Tensor, w_b: Optional[Tensor], w_down_t: Tensor, idx: Tensor,
                   activation: str, b_a: Optional[Tensor], b_b: Optional[Tensor], b_down: Optional[Tensor],
                   out: Optional[Tensor] = None) -> Tensor:
    """The C kernel (caller checked arguments and :func:`applies`); writes every element of out."""
    fn = _load()
    x = x.contiguous()
    nb, d = x.shape
    d_out = w_down_t.shape[1]
    if out is None:
        out = C.empty(nb, d_out, dtype=x.dtype, device=x.device)
    threads = torch.get_num_threads()
    scratch = C.empty(threads * nb * d_out, dtype=x.dtype, device=x.device)

    def ptr(t):
        return None if t is None else t.data_ptr()

    fn(x.data_ptr(), nb, d, d_out, w_a.data_ptr(), w_a.stride(0), ptr(w_b), 0 if w_b is None else w_b.stride(0),
       w_down_t.data_ptr(), w_down_t.stride(0), ptr(b_a), ptr(b_b), ptr(b_down),
       idx.data_ptr(), idx.shape[-1], 0 if idx.dim() == 1 else idx.stride(0), ACTIVATION_CODES[activation],
       out.data_ptr(), scratch.data_ptr(), threads, PREFETCH_ROWS, PREFETCH_BYTES)
    return out
