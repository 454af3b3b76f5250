#!/usr/bin/env bash
# The CUDA checks and the many-core numbers, in one run on a GPU machine.
#
# What it runs (each step time-boxed; a failing step is logged and the next one still runs):
#   1. the tests marked `gpu` (CUDA inference path with and without CUDA graphs, TorchRL's
#      cuda:0 AsyncBatchedCollector examples with AsyncPoolCollector swapped in);
#   2. benchmarks/compare_inference.py --device cuda (ours incl. CUDA graphs vs TorchRL's server);
#   3. benchmarks/compare_pool.py and compare_collectors.py on this machine's cores (the 2-core CI
#      machine is CPU-bound on the 2 ms env: these show the same code when it is not);
#   4. the default test suite (a portability check of the exchange on another kernel).
#
# Usage (repo root; wheels for torchrl/tensordict/gymnasium in .whl/ when the machine lacks them):
#   OUT=/tmp/out bash benchmarks/gpu_check.sh
#   STEPS="gpu_tests inference_cuda" OUT=/tmp/out bash benchmarks/gpu_check.sh   # a subset
# All steps together need up to ~14 minutes of boxes; a device call allows 10: split them.
# First run (2026-11-29, one H200): every step but the last finished; the default suite's first
# six tests (subprocess training smoke runs importing CUDA torch) used its whole 150 s box.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
STEPS=${STEPS:-"gpu_tests inference_cuda pool_manycore collectors_manycore default_suite"}
step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    case " $STEPS " in *" $name "*) ;; *) echo "=== $name: skipped (not in STEPS)"; return ;; esac
    echo "=== $name ($(date +%T), limit ${secs}s)"
    local t0=$SECONDS
    timeout -k 10 "$secs" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "=== $name: rc=${PIPESTATUS[0]} in $((SECONDS - t0))s"
}
$PY -c "import torch, torchrl, tensordict, gymnasium, os; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', '| torchrl', torchrl.__version__, '| tensordict', tensordict.__version__, '| gymnasium', gymnasium.__version__, '|', os.cpu_count(), 'CPUs')"
step gpu_tests 150 $PY -m pytest -m gpu -q -p no:cacheprovider -rs test/
step inference_cuda 150 $PY benchmarks/compare_inference.py --device cuda --envs 8 32 --duration 2 --warmup 1 --json "$OUT/inference_cuda.json"
step pool_manycore 90 $PY benchmarks/compare_pool.py --impls env-only ours ours-auto --envs 8 32 --seconds 3 --warmup 1 --json "$OUT/pool_manycore.json"
step collectors_manycore 120 $PY benchmarks/compare_collectors.py --impls asyncpool gym_async gym_sync --seconds 3 --json "$OUT/collectors_manycore.json"
step default_suite 420 $PY -m pytest -m "not slow" -v -x --timeout 240 -p no:cacheprovider
