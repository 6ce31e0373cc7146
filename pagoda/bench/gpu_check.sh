#!/usr/bin/env bash
# GPU check for the attention kernels: the CUDA kernel tests (pytest -m gpu) and the kernel benchmark.
# Needs no network: it uses the first python that imports torch (./.venv, then python3, python).
# Results go to "$OUT" if set, else ./out: env.txt, gpu_tests.txt/.xml, bench_kernels.md/.json.
# Usage: bash pagoda/bench/gpu_check.sh        (from anywhere; runs in the repository root)
set -u
cd "$(dirname "$0")/../.."
OUT_DIR="${OUT:-./out}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

PY=""
for candidate in ./.venv/bin/python python3 python; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" >/dev/null 2>&1; then
    PY="$candidate"
    break
  fi
done
if [ -z "$PY" ]; then
  echo "gpu_check: no python with torch found (tried ./.venv/bin/python, python3, python)" | tee "$OUT_DIR/env.txt"
  exit 2
fi

{
  echo "python: $PY"
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
  "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1 || echo "triton: not importable"
  "$PY" -c "import pytest; print('pytest', pytest.__version__)" 2>&1 || echo "pytest: not importable"
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
} 2>&1 | tee "$OUT_DIR/env.txt"

status=0
if "$PY" -c "import pytest" >/dev/null 2>&1; then
  # --noconftest: the kernel tests need none of the repository's fixtures (nor their dependencies)
  timeout 900 "$PY" -m pytest tests/kernels -m gpu --noconftest -p no:cacheprovider -q -rs \
    --junitxml "$OUT_DIR/gpu_tests.xml" 2>&1 | tee "$OUT_DIR/gpu_tests.txt"
  status=${PIPESTATUS[0]}
else
  echo "gpu_check: pytest missing; the benchmark's reference check below is the only correctness check" \
    | tee "$OUT_DIR/gpu_tests.txt"
fi

if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  bench_args=()
else
  echo "gpu_check: no CUDA device; running the CPU benchmark on a tiny grid instead"
  bench_args=(--quick)
fi
timeout 900 "$PY" -m pagoda.bench.kernels "${bench_args[@]}" --json "$OUT_DIR/bench_kernels.json" 2>&1 \
  | tee "$OUT_DIR/bench_kernels.md"
bench_status=${PIPESTATUS[0]}

echo "gpu_check: tests exit $status, benchmark exit $bench_status; results in $OUT_DIR"
[ "$status" -eq 0 ] && [ "$bench_status" -eq 0 ]
