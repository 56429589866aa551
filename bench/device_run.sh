#!/usr/bin/env bash
# One device call: facts about the machine, the GPU tests, then the allocator benchmark.
# Usage (on the GPU machine, repo root, with worker/_native.abi3.so carried): bash bench/device_run.sh [pytest args]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "thp: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null) memlock: $(ulimit -l) cpus: $(nproc)"
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"
python3 -m pytest tests -m gpu -p no:cacheprovider -q -s "$@" 2>&1 | tee "$OUT/gpu_tests.log"
python3 -m bench.bench_allocator --out "$OUT/bench_allocator.json" 2>&1 | tee "$OUT/bench_allocator.log"
