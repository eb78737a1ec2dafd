"""The CPU backend in C and C++, built on first use with the compilers Inductor uses on CPU anyway.

- ``cpu_sparse_mlp.c``: the sparse MLP kernel (one loop that reads each selected neuron's gate, up
  and down rows back to back, with a short software prefetch), the int8 predictor's GEMV
  (``int8.py``) and its fused scoring. Called through ctypes by the public ops. Torch has no op that
  reads rows this way: its own path is a gather-GEMV plus a second op over the down rows.
- ``cpu_ops.cpp``: the backend's CPU decode ops, registered with the dispatcher from C++
  (``load_ops``). Inductor's wrapper calls them without Python in between, which matters inside a
  compiled decode step, where a Python custom op's call overhead is comparable to the kernel.

Build: ``$CC``/``$CXX`` (else ``cc``/``c++``, ``gcc``/``g++``), ``-O3 -march=native -fopenmp``, the
activation table's names and codes as defines (``activations.c_defines()``), and torch's headers
for the C++ ops. Libraries are cached under ``$DEJAVU_CACHE/kernels`` keyed by the sources, flags
(defines included), compiler and CPU (and torch's version for the C++ ops), so a changed source or
table rebuilds and a home directory shared between machines is safe. When a build fails (or
``DEJAVU_CPU_NATIVE=0``), a warning says why once and the callers keep their torch/Inductor path.
The C++ ops take fp32, bf16 and fp16 weights as stored (the kernels widen them as they load and sum
in fp32); the ctypes entry points below are fp32 only.
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

from dejavu_compile import activations

from .. import _common as C

SOURCE = Path(__file__).with_name("cpu_sparse_mlp.c")
OPS_SOURCE = Path(__file__).with_name("cpu_ops.cpp")
# -ffp-contract=fast: fused multiply-adds in the dot products and row sums (ISO C mode, -std=c11,
# turns contraction off otherwise, and the C build would be slower than the same code as C++).
# $DEJAVU_CFLAGS adds flags (e.g. -mno-avx512f: the AVX2 paths on an AVX-512 machine, which
# DEJAVU_CFLAGS=-mno-avx512f python benchmarks/kernel_speed.py measures).
_COMMON_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fPIC", "-shared",
                 *activations.c_defines(), *os.environ.get("DEJAVU_CFLAGS", "").split())
FLAGS = (*_COMMON_FLAGS, "-std=c11")
# None: the machine's tuned prefetch (dejavu_tuning in cpu_sparse_mlp.c, which the C++ op uses too);
# benchmarks/kernel_speed.py --prefetch-sweep sets other (rows ahead, bytes per row).
PREFETCH_ROWS = None
PREFETCH_BYTES = None

W_F32 = 0  # DEJAVU_W_F32: the weight element code of the C kernels' fp32 rows

_STATE: dict = {"lib": None, "error": None, "enabled": os.environ.get("DEJAVU_CPU_NATIVE", "1") != "0"}
_OPS: dict = {"loaded": False, "error": None}
_LOCK = threading.Lock()


def _cpu_key() -> str:
    """What -march=native depends on: the CPU model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() + platform.machine()


def _compiler(names=("cc", "gcc", "clang"), env="CC") -> Optional[str]:
    for name in (os.environ.get(env), *names):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(cc: str, source: Path = SOURCE, flags: tuple = FLAGS, libs: tuple = ("-lm",),
           key_extra: str = "") -> Path:
    """Compile `source` into a shared library under the cache (once per source, flags, compiler, CPU)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [p.read_text() for p in sorted({source, SOURCE})]  # the C++ ops include the C kernel
    key = hashlib.sha256("\0".join([*texts, " ".join(flags), " ".join(libs), version, _cpu_key(), key_extra]).encode())
    from dejavu_compile.cache import cache_dir

    folder = cache_dir() / "kernels"
    target = folder / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        result = subprocess.run([cc, *flags, str(source), "-o", tmp, *libs], capture_output=True, text=True,
                                timeout=300)
        if result.returncode != 0:
            # the first error says why (an #error, a missing define); later ones are its echoes
            raise RuntimeError(f"{cc} failed: {result.stderr.strip()[:3000]}")
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
                path = _build(cc)
                lib = ctypes.CDLL(str(path))
                P, I = ctypes.c_void_p, ctypes.c_int64
                lib.dejavu_sparse_mlp.argtypes = [P, I, I, I, ctypes.c_int, P, I, P, I, P, I, P, P, P, P, I, I,
                                                  ctypes.c_int, P, P, ctypes.c_int, I, I]
                lib.dejavu_int8_linear_f32.argtypes = [P, I, I, P, I, P, P, P, P, ctypes.c_int]
                lib.dejavu_linear_f32.argtypes = [P, I, I, P, I, I, P, P, ctypes.c_int, I]
                lib.dejavu_q8_linear.argtypes = [P, I, I, P, I, P, I, P, P, P, P, ctypes.c_int]
                lib.dejavu_set_tuning.argtypes = [I, I, I, I]
                for fn in (lib.dejavu_sparse_mlp, lib.dejavu_int8_linear_f32, lib.dejavu_linear_f32,
                           lib.dejavu_q8_linear, lib.dejavu_set_tuning):
                    fn.restype = None
                _STATE["tuning"] = machine_tuning(lib, path.with_suffix(".tuning.json"))
                lib.dejavu_set_tuning(*_tuning_args())
                _STATE["lib"] = lib
            except Exception as err:  # no compiler, no OpenMP, a read-only cache: keep the torch path
                _STATE["error"] = f"{type(err).__name__}: {err}"
                warnings.warn(f"dejavu: the C sparse MLP kernel is unavailable ({_STATE['error']}); "
                              "CPU sparse MLPs use the slower torch/Inductor path", RuntimeWarning, stacklevel=3)
    return _STATE["lib"]


def vector_width() -> int:
    """fp32 lanes of the built kernels' vector loops: 16 (AVX-512), 8 (AVX2), 1 (scalar); 0 when the
    kernels are unavailable."""
    lib = _load()
    return 0 if lib is None else int(lib.dejavu_vector_width())


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
    fn = _load().dejavu_sparse_mlp
    code = activations.ACTIVATIONS[activation].code
    x = x.contiguous()
    nb, d = x.shape
    d_out = w_down_t.shape[1]
    if out is None:
        out = C.empty(nb, d_out, dtype=x.dtype, device=x.device)
    threads = torch.get_num_threads()
    scratch = C.empty(threads * nb * d_out, dtype=x.dtype, device=x.device)

    def ptr(t):
        return None if t is None else t.data_ptr()

    fn(x.data_ptr(), nb, d, d_out, W_F32, w_a.data_ptr(), w_a.stride(0), ptr(w_b), 0 if w_b is None else w_b.stride(0),
       w_down_t.data_ptr(), w_down_t.stride(0), ptr(b_a), ptr(b_b), ptr(b_down),
       idx.data_ptr(), idx.shape[-1], 0 if idx.dim() == 1 else idx.stride(0), code,
       out.data_ptr(), scratch.data_ptr(), threads, -1 if PREFETCH_ROWS is None else PREFETCH_ROWS,
       -1 if PREFETCH_BYTES is None else PREFETCH_BYTES)
    return out


def prefetch_default() -> tuple[int, int]:
    """The sparse MLP kernel's prefetch on this machine (rows ahead, bytes per row)."""
    t = tuning()
    return t["mlp_prefetch_rows"], t["mlp_prefetch_bytes"]


def tuning() -> dict:
    """The kernel settings in effect on this machine (measured once per build, see machine_tuning);
    empty when the C kernels are unavailable."""
    _load()
    return dict(_STATE.get("tuning") or {})


TUNING_FIELDS = ("mlp_prefetch_rows", "mlp_prefetch_bytes", "linear_prefetch_rows", "int8_prefetch_rows")


def apply_tuning(**settings: int) -> None:
    """Set the kernels' settings, in the C kernels and the C++ ops alike, to the machine's tuning with
    ``settings`` in place of some (for A/B measurements: ``apply_tuning(int8_prefetch_rows=0)``; no
    arguments: the machine's tuning again). Not persisted."""
    unknown = set(settings) - set(TUNING_FIELDS)
    if unknown:
        raise ValueError(f"unknown kernel settings {sorted(unknown)}; known: {TUNING_FIELDS}")
    lib = _load()
    if lib is None:
        return
    args = _tuning_args(**settings)
    lib.dejavu_set_tuning(*args)
    if "lib" in _OPS:
        _OPS["lib"].dejavu_set_tuning(*args)


def _tuning_args(**settings: int) -> tuple[int, ...]:
    """dejavu_set_tuning's arguments (the C struct's fields, in order): the machine's tuning, with
    ``settings`` in place of some."""
    values = {**_STATE["tuning"], **settings}
    return tuple(int(values[name]) for name in TUNING_FIELDS)


# What machine_tuning tries. Sparse MLP: (rows ahead, bytes per row); dense GEMVs: rows ahead.
MLP_PREFETCH_CHOICES = ((0, 0), (2, 256), (4, 256), (8, 256), (4, 1024), (8, 1024))
LINEAR_PREFETCH_CHOICES = (0, 2, 8)
INT8_PREFETCH_CHOICES = (0, 4, 8, 16)


def _tuning_struct(lib):
    """The library's C struct dejavu_tuning as an array of its int64 fields (TUNING_FIELDS' order), writable."""
    return (ctypes.c_int64 * len(TUNING_FIELDS)).in_dll(lib, "dejavu_tuning")


def held_tuning(lib) -> dict:
    """The settings the C kernels hold now: the compiled defaults until dejavu_set_tuning sets others."""
    return dict(zip(TUNING_FIELDS, _tuning_struct(lib)))


def machine_tuning(lib, path: Path) -> dict:
    """The prefetch settings that run fastest on this machine, measured once per built library and
    cached beside it (``*.tuning.json``; delete it to measure again). About a second: a sparse MLP
    at density 0.25, a dense GEMV over weights larger than a 32 MiB last-level cache and an int8 GEMV
    (``quantize_weights``' format) over the same weights as int8, each setting timed interleaved with
    the others, medians of 7 rounds. ``DEJAVU_CPU_TUNE=0`` keeps the compiled defaults; a file without
    a setting (written before it existed) takes the value the kernels hold (the compiled default)."""
    import json

    defaults = held_tuning(lib)
    if os.environ.get("DEJAVU_CPU_TUNE", "1") == "0":
        return defaults
    try:
        return {**defaults, **json.loads(path.read_text())}
    except (OSError, ValueError):
        pass
    import statistics
    import time

    gen = torch.Generator().manual_seed(0)
    d, n, copies, threads = 1024, 4096, 3, torch.get_num_threads()
    weights = [torch.randn(3, n, d, generator=gen) for _ in range(copies)]  # 3 copies of 48 MiB: gate, up, down^T
    x = torch.randn(1, d, generator=gen)
    out = torch.empty(1, 3 * n)  # the GEMV reads the three matrices as one (3n, d)
    scratch = torch.empty(threads * d)
    idx = [torch.randperm(n, generator=gen)[: n // 4].sort().values for _ in range(copies)]

    def mlp(setting, i):
        w = weights[i]
        lib.dejavu_sparse_mlp(x.data_ptr(), 1, d, d, W_F32, w[0].data_ptr(), d, w[1].data_ptr(), d, w[2].data_ptr(), d,
                              None, None, None, idx[i].data_ptr(), idx[i].numel(), 0,
                              activations.ACTIVATIONS["silu"].code, out.data_ptr(), scratch.data_ptr(), threads,
                              *setting)

    def linear(setting, i):
        w = weights[i]
        lib.dejavu_linear_f32(x.data_ptr(), 1, d, w.data_ptr(), d, 3 * n, None, out.data_ptr(), threads, setting)

    # the fp32 weights' bytes read as int8 rows of 512: the same bytes as the other two measure, in rows
    # as short as a small model's (SmolLM2's are 576 bytes), where the prefetch matters: the hardware
    # prefetcher ramps up within a long row by itself, so long rows measured noise
    group, d8 = 32, 512
    rows8 = 3 * n * d * 4 // d8
    int8 = [(w.view(torch.int8).reshape(rows8, d8), torch.rand(rows8, d8 // group, generator=gen)) for w in weights]
    x8, xq, inv = torch.randn(1, d8, generator=gen), torch.empty(d8, dtype=torch.int16), torch.empty(1)
    out8 = torch.empty(1, rows8)
    struct = _tuning_struct(lib)

    def int8_linear(setting, i):
        struct[TUNING_FIELDS.index("int8_prefetch_rows")] = setting  # the kernel reads it from the struct
        q, scales = int8[i]
        lib.dejavu_q8_linear(x8.data_ptr(), 1, d8, q.data_ptr(), rows8, scales.data_ptr(), group, None,
                             out8.data_ptr(), xq.data_ptr(), inv.data_ptr(), threads)

    def fastest(run, choices):
        times = {c: [] for c in choices}
        for rep in range(8):
            for c in choices:
                start = time.perf_counter()
                for i in range(copies):
                    run(c, i)
                if rep:  # the first round warms up
                    times[c].append(time.perf_counter() - start)
        return min(choices, key=lambda c: statistics.median(times[c]))

    mlp_rows, mlp_bytes = fastest(mlp, MLP_PREFETCH_CHOICES)
    settings = {"mlp_prefetch_rows": mlp_rows, "mlp_prefetch_bytes": mlp_bytes,
                "linear_prefetch_rows": fastest(linear, LINEAR_PREFETCH_CHOICES),
                "int8_prefetch_rows": fastest(int8_linear, INT8_PREFETCH_CHOICES)}
    lib.dejavu_set_tuning(*defaults.values())  # measuring the int8 GEMV wrote its setting into the struct
    try:
        path.write_text(json.dumps(settings))
    except OSError:  # a read-only cache: measured again next time
        pass
    return settings


def int8_linear_f32(x: Tensor, w_int8: Tensor, scale: Tensor) -> Tensor:
    """(B, d) fp32 x (n, d) int8 rows with per-row scales -> (B, n) fp32, x quantized to int16 per
    row (the caller checked arguments and :func:`available`; w_int8 and scale contiguous)."""
    x = x.contiguous()
    nb, d = x.shape
    n = w_int8.shape[0]
    out = C.empty(nb, n, dtype=torch.float32, device=x.device)
    x_int16 = torch.empty(nb, d, dtype=torch.int16)
    x_scale = torch.empty(nb, dtype=torch.float32)
    _load().dejavu_int8_linear_f32(x.data_ptr(), nb, d, w_int8.data_ptr(), n, scale.data_ptr(), out.data_ptr(),
                                   x_int16.data_ptr(), x_scale.data_ptr(), torch.get_num_threads())
    return out


# ---------------------------------------------------------------------------------------------
# The backend's CPU decode ops, registered from C++ (cpu_ops.cpp): no Python between Inductor's
# wrapper and the kernel. dejavu::cpu_sparse_mlp runs the C kernel above; dejavu::cpu_glu_int8_topk
# scores neurons with the int8 predictor and keeps the top k (ascending ids) in the same call;
# dejavu::cpu_glu_int8_mlp also finishes the block from the predictor's own values (down rows only).


def load_ops() -> bool:
    """Build (once per machine, with the C++ compiler Inductor uses) and load the C++ ops; False,
    with one warning naming the reason, when that fails (the backend then keeps its aten lowering)."""
    if not _STATE["enabled"]:
        return False
    if _OPS["loaded"] or _OPS["error"] is not None:
        return _OPS["loaded"]
    lib = _load()  # the C kernels' library and the machine's tuning (before the lock: _load takes it)
    with _LOCK:
        if not _OPS["loaded"] and _OPS["error"] is None:
            try:
                cxx = _compiler(("c++", "g++", "clang++"), "CXX")
                if cxx is None:
                    raise RuntimeError("no C++ compiler found (set $CXX)")
                from torch.utils import cpp_extension

                flags = (*_COMMON_FLAGS, "-std=c++20", "-w",
                         f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                         *(f"-I{p}" for p in cpp_extension.include_paths()))
                libs = (*(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu", "-lm")
                ops_path = _build(cxx, OPS_SOURCE, flags, libs, key_extra=torch.__version__)
                torch.ops.load_library(str(ops_path))
                if lib is not None:  # the machine's tuning (the C++ ops hold their own copy of it)
                    _OPS["lib"] = ctypes.CDLL(str(ops_path))
                    set_tuning = _OPS["lib"].dejavu_set_tuning
                    set_tuning.argtypes, set_tuning.restype = [ctypes.c_int64] * len(TUNING_FIELDS), None
                    set_tuning(*_tuning_args())
                _register_fakes()
                _OPS["loaded"] = True
            except Exception as err:
                _OPS["error"] = f"{type(err).__name__}: {err}"
                warnings.warn(f"dejavu: the C++ CPU decode ops are unavailable ({_OPS['error']}); the backend "
                              "lowers CPU sparse MLPs to aten ops instead", RuntimeWarning, stacklevel=2)
    return _OPS["loaded"]


def _register_fakes() -> None:
    @torch.library.register_fake("dejavu::cpu_sparse_mlp")
    def _(x, w_a, w_b, w_down_t, idx, activation, b_a=None, b_b=None, b_down=None):
        C.check_mlp(x, w_a, w_b, w_down_t, idx, activation, b_a, b_b, b_down, "w_a", "w_b")
        return x.new_empty(x.shape[0], w_down_t.shape[1])

    def _check_int8_predictor(x, w_int8, scale, activation):
        # dtypes and ranks only: the C++ kernel checks the sizes (a size test here would put a guard
        # on the graph constant's size, which Dynamo cannot express)
        C.check_x(x)
        C.check_activation(activation)
        if w_int8.dtype != torch.int8 or w_int8.dim() != 2 or scale.dim() != 1:
            raise ValueError(f"w_int8 must be int8 (2F, d) and scale (2F,), got {w_int8.dtype} "
                             f"{tuple(w_int8.shape)} and {tuple(scale.shape)}")

    @torch.library.register_fake("dejavu::cpu_glu_int8_topk")
    def _(x, w_int8, scale, k, activation):
        _check_int8_predictor(x, w_int8, scale, activation)
        return x.new_empty(x.shape[0], k, dtype=torch.int64)

    @torch.library.register_fake("dejavu::cpu_glu_int8_mlp")
    def _(x, w_int8, scale, w_down_t, k, activation, b_down=None):
        _check_int8_predictor(x, w_int8, scale, activation)  # sizes: the C++ kernel checks them (see above)
        if w_down_t.dim() != 2:
            raise ValueError(f"w_down_t must be (F, d_out), got {tuple(w_down_t.shape)}")
        return x.new_empty(x.shape[0], w_down_t.shape[1]), x.new_empty(x.shape[0], k, dtype=torch.int64)

    @torch.library.register_fake("dejavu::cpu_linear")
    def _(x, w, b=None):
        return x.new_empty(*x.shape[:-1], w.shape[0])

    @torch.library.register_fake("dejavu::cpu_q8_linear")
    def _(x, q, scales, b=None):
        if q.dtype != torch.int8 or q.dim() != 2 or scales.dim() != 2:  # sizes: the C++ kernel checks them
            raise ValueError(f"q must be int8 (n, d) and scales (n, groups), got {q.dtype} {tuple(q.shape)} and "
                             f"{tuple(scales.shape)}")
        return x.new_empty(*x.shape[:-1], q.shape[0])

    @torch.library.register_fake("dejavu::cpu_linear_cat")
    def _(x, w, b=None):
        return x.new_empty(*x.shape[:-1], sum(wi.shape[0] for wi in w))

    @torch.library.register_fake("dejavu::cpu_q8_linear_cat")
    def _(x, q, scales, b=None):
        if len(q) != len(scales) or any(qi.dtype != torch.int8 or qi.dim() != 2 for qi in q):
            # sizes: the C++ kernel checks them
            raise ValueError("q must be int8 weights (n, d), one scales tensor each")
        return x.new_empty(*x.shape[:-1], sum(qi.shape[0] for qi in q))

    @torch.library.register_fake("dejavu::cpu_q8_sparse_mlp")
    def _(x, q_a, s_a, q_b, s_b, q_down_t, s_down_t, idx, activation, b_a=None, b_b=None, b_down=None):
        C.check_x(x)
        C.check_activation(activation)
        if any(q is not None and (q.dtype != torch.int8 or q.dim() != 2) for q in (q_a, q_b, q_down_t)):
            raise ValueError("q_a, q_b and q_down_t must be int8 (n, width)")  # sizes: the C++ kernel checks them
        return x.new_empty(x.shape[0], q_down_t.shape[1])

    @torch.library.register_fake("dejavu::cpu_q8_glu_mlp")
    def _(x, q_a, s_a, q_b, s_b, q_down_t, s_down_t, k, activation, b_down=None):
        C.check_x(x)
        C.check_activation(activation)
        if any(q.dtype != torch.int8 or q.dim() != 2 for q in (q_a, q_b, q_down_t)):
            raise ValueError("q_a, q_b and q_down_t must be int8 (n, width)")  # sizes: the C++ kernel checks them
        return x.new_empty(x.shape[0], q_down_t.shape[1]), x.new_empty(x.shape[0], k, dtype=torch.int64)

    @torch.library.register_fake("dejavu::cpu_screened_linear")
    def _(x, w, w_int8, scale, k, b=None):
        if w_int8.dtype != torch.int8 or w_int8.dim() != 2 or scale.dim() != 1:  # sizes: the C++ kernel checks them
            raise ValueError(f"w_int8 must be int8 (n, d) and scale (n,), got {w_int8.dtype} "
                             f"{tuple(w_int8.shape)} and {tuple(scale.shape)}")
        return x.new_empty(*x.shape[:-1], w.shape[0])

    @torch.library.register_fake("dejavu::cpu_decode_attention")
    def _(q, k, v, attn_mask=None, scale=None):
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:  # sizes: the C++ kernel checks them
            raise ValueError(f"q (B, H, L, D), k and v (B, H_kv, S, D) expected, got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        return q.new_empty(q.shape)
