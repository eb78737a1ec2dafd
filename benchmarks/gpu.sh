#!/usr/bin/env bash
# Everything that needs CUDA, in one run: the CUDA tests, the kernel benchmark (Triton vs
# cuBLAS, CUDA-graph replays) and the decode benchmark on LLaMA-7B-shaped random layers.
#
#     OUT=benchmarks/results/gpu bash benchmarks/gpu.sh
#
# Runs with the machine's own python3/torch/triton/transformers (nothing is downloaded); each step
# has its own time limit, so one that fails or overruns leaves the others' results.
set -u
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/dejavu-inductor
PY=python3

{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  $PY -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  nproc; } 2>&1 | tee "$OUT/env.txt"

# The package without its dependencies (the machine has them); if pip cannot build it offline,
# put it on the path and declare the backend's entry point in a dist-info folder.
if ! $PY -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/env.txt" 2>&1; then
  mkdir -p /tmp/site/dejavu_compile-0.dist-info
  printf 'Metadata-Version: 2.1\nName: dejavu-compile\nVersion: 0\n' >/tmp/site/dejavu_compile-0.dist-info/METADATA
  printf '[torch_dynamo_backends]\ndejavu = dejavu_compile.compiler.backend:dejavu_backend\n' >/tmp/site/dejavu_compile-0.dist-info/entry_points.txt
  export PYTHONPATH=/tmp/site:$PWD
  echo "pip install failed: using PYTHONPATH and a hand-made entry point" | tee -a "$OUT/env.txt"
fi

step() {  # step NAME LIMIT_S COMMAND...: run with a limit, log to $OUT/NAME.txt, report the time
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
  echo "== $name: exit $? after $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
  tail -n 25 "$OUT/$name.txt"
}

step tests-cuda 150 $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py
step kernels 160 $PY benchmarks/kernels.py --out "$OUT/kernels-cuda.json"
step decode 280 $PY benchmarks/decode.py --device cuda --dtype float16 --skip-smollm2 --synthetic-shape 7b \
  --synthetic-layers 4 --mode reduce-overhead --new-tokens 64 --repeats 3 --attn-density 0.5 --out "$OUT/decode-cuda.json"
step tests-triton 60 $PY -m pytest -q -p no:cacheprovider -x tests/test_kernels_triton.py tests/test_kernels_compile.py
