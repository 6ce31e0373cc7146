#!/usr/bin/env bash
# The GPU check: everything pagoda has that needs a GPU, in one run that fits one call of a lent machine.
#
#   bash pagoda/bench/gpu_check.sh [--quick]      (from anywhere; runs in the repository root)
#
# Sections, in order, each under its own time limit and all of them under one deadline ($GPU_CHECK_DEADLINE
# seconds, 420 by default; a section that would start with under 25 s left is skipped); a section that fails
# never stops the next:
#   env          python, torch, triton, CUDA versions and nvidia-smi
#   tests        the GPU kernel tests (tests/kernels/test_triton_*.py, tests/core/test_sampler_gpu.py) and the
#                CUDA graph tests (tests/model/test_cuda_graphs.py)
#   kernels      pagoda bench kernels: decode (batch 1/16/64 x context 1k/4k/16k) as a share of copy bandwidth,
#                the invariant backend beside it, prefill against torch SDPA, the decode kernel's variants
#   offline_1b   pagoda bench offline, Llama-3.2-1B shape, bfloat16, 1/16/64 prompts, step split, and the
#                batch-invariant kernels' cost
#   graphs_1b    the same shape and prompts without and with CUDA graphs for decode steps (--cuda-graphs): the
#                step split of both, and their tokens and sampled logits rows compared bitwise (exit 1 if not equal)
#   offline_8b   offline_1b at the Llama-3.1-8B shape
#   invariance   one prompt alone vs in a crowd of 64: per op and end to end, default and invariant modes
#   models       a random-weight SmolLM2-135M-shaped Hugging Face directory with a tokenizer made here
#   serve        pagoda serve --device cuda on it, driven by the openai and anthropic SDKs, and a disconnect
#   moe          the Qwen3-MoE path through the engine
#   nccl         pagoda generate with a tensor-parallel group of one rank on NCCL
# Without CUDA (or with --quick) every section runs on the CPU at tiny shapes, to test the script itself.
# Wheels in ./.whl (what the machine's python lacks) are installed first into /tmp/site, without network.
# Results: $OUT (else ./out): summary.md (the machine, a status table, each section's tables), results.json
# (every section's measurements), log.txt (everything, with timestamps), gpu_tests.xml (pytest's JUnit file).
set -u
cd "$(dirname "$0")/../.."
ROOT="$PWD"
OUT_DIR="${OUT:-./out}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
LOG="$OUT_DIR/log.txt"
PARTS="$(mktemp -d /tmp/pagoda_gpu_check.XXXXXX)"
MODELS="$PARTS/models"
START=$(date +%s)
DEADLINE="${GPU_CHECK_DEADLINE:-420}"
: > "$LOG"
export PYTHONUNBUFFERED=1

say() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  say "installing $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$LOG" 2>&1 || say "wheel install failed (see log.txt)"
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

PY=""
for candidate in ./.venv/bin/python python3 python; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" >/dev/null 2>&1; then
    PY="$candidate"
    break
  fi
done
if [ -z "$PY" ]; then
  say "no python with torch found (tried ./.venv/bin/python, python3, python)"
  exit 2
fi

QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || QUICK=1

{
  echo "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu', torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else '', 'SMs' if torch.cuda.is_available() else '')"
  "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1 || echo "triton: not importable"
  for m in pytest xdist litestar uvicorn openai anthropic pydantic msgspec; do
    "$PY" -c "import $m; print('$m', getattr($m, '__version__', ''))" 2>/dev/null || echo "$m: not importable"
  done
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi
  echo "git: $(git rev-parse --short HEAD 2>/dev/null) $(git status --short 2>/dev/null | wc -l) files changed; quick mode: $QUICK"
} > "$PARTS/env.out" 2>&1
cat "$PARTS/env.out" | tee -a "$LOG"

report() { "$PY" -m pagoda.bench.gpu_report "$PARTS" "$OUT_DIR" >> "$LOG" 2>&1; }

# section NAME LIMIT_S CMD...: run CMD under min(LIMIT_S, what the deadline leaves), output to the log and to
# $PARTS/NAME.out; a JSON it writes goes to $PARTS/NAME.json (the command gets the path in $JSON)
section() {
  local name=$1 limit=$2
  shift 2
  local left=$(( DEADLINE - ($(date +%s) - START) ))
  if [ "$left" -lt 25 ]; then
    say "SKIP $name: ${left}s left before the deadline"
    printf '%s\tskipped\t0\n' "$name" >> "$PARTS/status.tsv"
    report
    return
  fi
  [ "$limit" -gt $(( left - 10 )) ] && limit=$(( left - 10 ))
  say "START $name (limit ${limit}s)"
  local t0=$(date +%s)
  JSON="$PARTS/$name.json" timeout -k 15 "$limit" "$@" > "$PARTS/$name.out" 2>&1
  local rc=$?
  sed "s/^/    [$name] /" "$PARTS/$name.out" >> "$LOG"
  say "END $name: exit $rc in $(( $(date +%s) - t0 ))s"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$PARTS/status.tsv"
  report
}

# ---------------------------------------------------------------- the sections
TESTS=(tests/kernels/test_triton_gpu.py tests/kernels/test_triton_matmul.py tests/kernels/test_triton_interpret.py
       tests/core/test_sampler_gpu.py tests/model/test_cuda_graphs.py)
XDIST=()
[ "$QUICK" = 0 ] && "$PY" -c "import xdist" >/dev/null 2>&1 && XDIST=(-n 8)
# on a GPU the kernels run compiled; the interpreter cases are the CPU's (Triton 3.6's interpreter fails on
# numpy 2.5's scalars there, before any kernel of ours runs)
[ "$QUICK" = 0 ] && XDIST+=(-m "not triton_interpret")
# --noconftest: the kernel tests need none of the repository's fixtures (nor their dependencies)
section tests 150 "$PY" -m pytest "${TESTS[@]}" "${XDIST[@]}" --noconftest -p no:cacheprovider -q -rfEs \
  --junitxml "$OUT_DIR/gpu_tests.xml"

if [ "$QUICK" = 1 ]; then
  section kernels 120 sh -c '"$0" -m pagoda.bench.kernels --device cpu --quick --reps 1 --threads 1 --json "$JSON"' "$PY"
  OFFLINE=(--device cpu --num-prompts 1,4 --prompt-lens 32 --max-tokens 8 --split --compare-invariance --no-hf)
  section offline_1b 120 sh -c '"$0" -m pagoda bench offline --model tiny "$@" --json "$JSON"' "$PY" "${OFFLINE[@]}"
  GRAPHS=(--device cpu --num-prompts 1,4 --prompt-lens 32 --max-tokens 8 --split --compare-cuda-graphs --no-hf
          --no-single-stream)
  section graphs_1b 60 sh -c '"$0" -m pagoda bench offline --model tiny "$@" --json "$JSON"' "$PY" "${GRAPHS[@]}"
  section invariance 120 sh -c '"$0" -m pagoda.bench.gpu_invariance --model tiny --device cpu --crowd 8 \
    --prompt-len 60 --max-tokens 6 --budget 64 --json "$JSON"' "$PY"
  section models 60 "$PY" -m pagoda.bench.gpu_model "$MODELS/serve" --shape tiny --dtype float32 --device cpu
  section serve 120 sh -c '"$0" -m pagoda.bench.gpu_serve_check --model "$1" --device cpu --disconnect-tokens 900 \
    --log "$2" --json "$JSON" -- --num-blocks 512' "$PY" "$MODELS/serve" "$PARTS/serve_server.log"
  section moe 120 sh -c '"$0" -m pagoda.bench.gpu_extras moe --device cpu --rows 1,4 --max-tokens 4 --json "$JSON"' "$PY"
  section nccl 120 sh -c '"$0" -m pagoda.bench.gpu_extras nccl --model "$1" --device cpu --max-tokens 8 \
    --json "$JSON"' "$PY" "$MODELS/serve"
else
  section kernels 90 sh -c '"$0" -m pagoda.bench.kernels --sweep --json "$JSON"' "$PY"
  OFFLINE=(--device cuda --dtype bfloat16 --num-prompts 1,16,64 --prompt-lens 128 --max-tokens 64 --split
           --compare-invariance --no-hf)
  section offline_1b 80 sh -c '"$0" -m pagoda bench offline --model llama-3.2-1b "$@" --json "$JSON"' "$PY" "${OFFLINE[@]}"
  GRAPHS=(--device cuda --dtype bfloat16 --num-prompts 1,16,64 --prompt-lens 128 --max-tokens 64 --split
          --compare-cuda-graphs --no-hf --no-single-stream)
  section graphs_1b 60 sh -c '"$0" -m pagoda bench offline --model llama-3.2-1b "$@" --json "$JSON"' "$PY" "${GRAPHS[@]}"
  section offline_8b 100 sh -c '"$0" -m pagoda bench offline --model llama-3.1-8b "$@" --json "$JSON"' "$PY" "${OFFLINE[@]}"
  section invariance 80 sh -c '"$0" -m pagoda.bench.gpu_invariance --model llama-3.2-1b --json "$JSON"' "$PY"
  section models 40 "$PY" -m pagoda.bench.gpu_model "$MODELS/serve" --shape smollm2-135m --dtype bfloat16
  section serve 90 sh -c '"$0" -m pagoda.bench.gpu_serve_check --model "$1" --device cuda --disconnect-tokens 6000 \
    --log "$2" --json "$JSON" -- --dtype bfloat16 --num-blocks 4096' "$PY" "$MODELS/serve" "$PARTS/serve_server.log"
  section moe 50 sh -c '"$0" -m pagoda.bench.gpu_extras moe --device cuda --json "$JSON"' "$PY"
  section nccl 70 sh -c '"$0" -m pagoda.bench.gpu_extras nccl --model "$1" --device cuda --max-tokens 16 \
    --json "$JSON"' "$PY" "$MODELS/serve"
fi

if [ -f "$PARTS/serve_server.log" ]; then
  { echo "---- the server's stderr (last 80 lines)"; tail -n 80 "$PARTS/serve_server.log"; } >> "$LOG"
fi
report
failed=$(awk -F'\t' '$2 != 0' "$PARTS/status.tsv" | wc -l)
say "done: $(( $(wc -l < "$PARTS/status.tsv") - failed )) of $(wc -l < "$PARTS/status.tsv") sections ok; results in $OUT_DIR"
cat "$OUT_DIR/summary.md"
rm -rf "$PARTS"
[ "$failed" -eq 0 ]
