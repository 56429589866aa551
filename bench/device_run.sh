#!/usr/bin/env bash
# One device call: the GPU tests (every test marked gpu, incl. the cuda variants of the semantic
# tests), then the allocator benchmark (SKIP_BENCH=1: not), the 8B-shaped reference check against
# transformers (REFERENCE_8B=1), the line-rate bench (LINE_RATE=1) and the start-up side by side
# against a base tree (STARTUP_AB_BASE=<dir>, carried: bench/startup_ab.py says how to make one;
# STARTUP_AB_ROUNDS, default 3) and what a start's import thread waits for (THREAD_STATES=1:
# bench_startup --thread-states, bench/thread_states.py). Run
# from the repo root on the GPU machine, with the built extension (worker/_native.abi3.so), the
# generated stubs (memsvc/v1) and .whl carried.
# Usage: bash bench/device_run.sh [extra pytest args]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  wheels=(.whl/*.whl)
  # numpy: only where the machine has none (its torch was built against the one it has)
  python3 -c "import numpy" 2>/dev/null && wheels=($(ls .whl/*.whl | grep -v /numpy-))
  if [ ${#wheels[@]} -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
# protobuf's compiled implementation, as users' installs have it: on a lent host (2026-12-07) the
# services imported another google.protobuf than the carried wheel's, a pure-Python one (every
# message 8-18x slower; the services now warn of it). A google package of ours that extends its path
# (pkgutil) puts the carried one first; not yet tried on a GPU host: this prints what it got.
PB_IMPL='from google.protobuf.internal import api_implementation as a; import google.protobuf as p; print("protobuf", p.__version__, a.Type(), p.__file__)'
if [ -d /tmp/site/google ] && [ "$(python3 -c "$PB_IMPL" | cut -d' ' -f3)" = python ]; then
  [ -f /tmp/site/google/__init__.py ] || echo "__path__ = __import__('pkgutil').extend_path(__path__, __name__)" > /tmp/site/google/__init__.py
fi
python3 -c "$PB_IMPL"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "thp: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null) memlock: $(ulimit -l) cpus: $(nproc)"
python3 -c "import torch, sys, grpc, numpy, google.protobuf as pb; print('python', sys.version.split()[0], 'torch', torch.__version__, 'grpc', grpc.__version__, 'protobuf', pb.__version__, 'numpy', numpy.__version__)"
python3 -m pytest tests -m gpu -p no:cacheprovider -q -rs "$@" 2>&1 | tee "$OUT/gpu_tests.log"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m bench.bench_allocator --out "$OUT/bench_allocator.json" 2>&1 | tee "$OUT/bench_allocator.log"
fi
if [ "${REFERENCE_8B:-0}" = 1 ]; then
  python3 -m bench.reference_8b --out "$OUT/reference_8b.json" --dir /tmp/ref8b 2>&1 | grep -v "it/s]" | tee "$OUT/reference_8b.log"
fi
if [ "${LINE_RATE:-0}" = 1 ]; then
  python3 -m bench.bench_line_rate --out "$OUT/line_rate.json" 2>&1 | tee "$OUT/line_rate.log"
fi
if [ -n "${STARTUP_AB_BASE:-}" ] || [ "${THREAD_STATES:-0}" = 1 ]; then
  # the 8B-shaped checkpoint with a tokenizer of Llama 3's size (a real model's read, bench/bpe_tokenizer.py)
  python3 -c "from pathlib import Path; from bench.bench_gateway import write_checkpoint; write_checkpoint(Path('/tmp/ck8b'), '8b', 'cuda')"
  python3 -m bench.bpe_tokenizer /tmp/ck8b
fi
if [ "${THREAD_STATES:-0}" = 1 ]; then
  python3 -m bench.bench_startup --model /tmp/ck8b --repeats 3 --warmup 1 --no-baseline --no-breakdown --thread-states \
    --out "$OUT/startup_threads.json" 2>&1 | tail -14 | tee "$OUT/startup_threads.log"
  python3 -c "import json, sys; [print(json.dumps({k: r.get(k) for k in ('first_token_s', 'import_thread_states', 'main_thread_states', 'other_busiest_threads')})) for r in json.load(open(sys.argv[1]))['worker']['runs']]" "$OUT/startup_threads.json"
fi
if [ -n "${STARTUP_AB_BASE:-}" ]; then
  python3 -m bench.startup_ab --base "$STARTUP_AB_BASE" --rounds "${STARTUP_AB_ROUNDS:-3}" --out "$OUT/startup_ab.json" -- \
    --model /tmp/ck8b --repeats 2 --warmup 1 --no-baseline --no-breakdown 2>&1 | tail -14 | tee "$OUT/startup_ab.log"
fi
