"""The CPU kernels' property tests again on the AVX2 build of an AVX-512 machine (``DEJAVU_CFLAGS=
-mno-avx512f``, the flag ``benchmarks/kernel_speed.py`` takes for the AVX2 paths): the two builds have separate
vector loops (16 and 8 lanes, separate widening of bf16 and fp16 weights), and a machine runs only
its own by default."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dejavu_compile.kernels.cpu import native

ROOT = Path(__file__).resolve().parents[1]


def _has_avx512() -> bool:
    try:
        return " avx512f " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx512(), reason="an AVX2-only machine runs the AVX2 build by default")
@pytest.mark.skipif(not native.load_ops(), reason=f"C++ ops unavailable: {native._OPS['error']}")
def test_kernels_on_the_avx2_build():
    assert native.vector_width() == 16  # this process: the machine's own (AVX-512) build
    env = {**os.environ, "DEJAVU_CFLAGS": f"{os.environ.get('DEJAVU_CFLAGS', '')} -mno-avx512f".strip()}
    width = subprocess.run([sys.executable, "-c", "from dejavu_compile.kernels.cpu import native; "
                            "print(native.vector_width(), native.load_ops())"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert width.stdout.split() == ["8", "True"], width.stdout + width.stderr
    tests = ["tests/test_dense_linear.py::test_cpu_linear_matches_float64",
             "tests/test_dense_linear.py::test_cpu_linear_reads_every_half_precision_value_exactly",
             "tests/test_dense_linear.py::test_cpu_linear_cat_is_each_projection_concatenated",
             "tests/test_quantized_weights.py::test_cpu_q8_linear_cat_is_each_projection_concatenated",
             "tests/test_kernels_cpu_ops.py::test_cpu_sparse_mlp_matches_masked_dense",
             "tests/test_kernels_cpu_ops.py::test_cpu_glu_int8_mlp_sums_the_predictors_values",
             "tests/test_head_screen.py::test_cpu_screened_linear_is_exact_on_the_top_k_of_its_estimates",
             "tests/test_quantized_weights.py::test_cpu_q8_linear_matches_float64_of_its_weight",
             "tests/test_quantized_weights.py::test_cpu_q8_linear_bad_input_and_opcheck",
             "tests/test_q8_sparse_mlp.py::test_cpu_q8_sparse_mlp_matches_float64_of_its_weights",
             "tests/test_q8_sparse_mlp.py::test_kept_neuron_values_are_the_dense_int8_projections_to_the_bit",
             "tests/test_q8_glu_mlp.py::test_cpu_q8_glu_mlp_keeps_the_top_k_and_matches_float64",
             "tests/test_decode_attention.py::test_decode_attention_matches_float64"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
