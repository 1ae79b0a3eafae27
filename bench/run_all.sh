#!/usr/bin/env bash
# Every benchmark of docs/RESULTS.md section 5, one after another (never two at once: they would share the
# cores). Usage: bench/run_all.sh STEER_DIR [THREADS] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
steer="${1:?usage: bench/run_all.sh STEER_DIR [THREADS] [OUT_DIR]}"
threads="${2:-2}"
out="${3:-runs/bench}"
py=.venv/bin/python
export OMP_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads"
$py bench/steering_overhead.py --threads "$threads" --steer "$steer" --batch-sizes 1 --prompts 8 \
  --repeats 3 --no-autograd --out "$out/steering_b1.json"
$py bench/steering_overhead.py --threads "$threads" --steer "$steer" --batch-sizes 8,32 --prompts 32 \
  --repeats 3 --no-autograd --out "$out/steering_b8_32.json"
$py bench/capture_overhead.py --threads "$threads" --repeats 3 --out "$out/capture_overhead.json"
$py bench/label_states.py --threads "$threads" --out "$out/label_states.json"
$py bench/orbh_end_to_end.py --threads "$threads" --steer "$steer" --max-new-tokens 48 --repeats 2 \
  --out "$out/orbh_end_to_end.json"
$py bench/serve_throughput.py --threads "$threads" --steer "$steer" --prompts 32 --repeats 2 \
  --out "$out/serve_throughput.json"
