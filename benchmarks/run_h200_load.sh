#!/usr/bin/env bash
# The H200 reliability sitting (issue "Reliability under load"): the restart test that
# needs AMX kernels, then `vllm-kt bench --load` - kt-hybrid, plain vLLM and
# --cpu-offload-gb behind `vllm serve` under `vllm bench serve`, CUDA graphs at vLLM's
# default compilation. Run from the repo root on a GPU host prepared as in
# ../shared/gpu-host/README.md; detached: `setsid nohup bash benchmarks/run_h200_load.sh &`.
# Everything goes to $BENCH_OUT; DONE marks the end.
set -uo pipefail
BENCH_OUT=${BENCH_OUT:-/root/bench-out}
mkdir -p "$BENCH_OUT"
[ -f /root/gpusite/env.sh ] && source /root/gpusite/env.sh
export PYTHONUNBUFFERED=1
export VLLM_KT_TEST_MODEL_CACHE=${VLLM_KT_TEST_MODEL_CACHE:-/root/tiny-models}
stage() { echo "$(date +%T) $*" | tee -a "$BENCH_OUT/stages.log"; }

stage "install"
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /root/gpusite . \
    > "$BENCH_OUT/install.log" 2>&1 || python3 -m pip install -q --no-deps -e . >> "$BENCH_OUT/install.log" 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$BENCH_OUT/host.txt" 2>&1
lscpu >> "$BENCH_OUT/host.txt" 2>&1

if [ -z "${SKIP_TESTS:-}" ]; then
  stage "restart test"
  python3 -m pytest tests/engine/test_restarts.py -v -s -rs -p no:cacheprovider > "$BENCH_OUT/restart-test.log" 2>&1
  stage "restart test exit $?"
fi

stage "load bench"
python3 -m vllm_kt_plugin.cli.main bench --shape qwen3-30b-a3b --gpu-weight-gb 17 --methods AMXINT4 \
    --load 1000:64 --offload-load 200:64 --load-input-len 128 --load-output-len 16 \
    --workdir /root/bench-work --out "$BENCH_OUT/h200_load_qwen3_30b_a3b.json" > "$BENCH_OUT/load-bench.log" 2>&1
stage "load bench exit $?"
tar czf "$BENCH_OUT/load-logs.tgz" -C /root/bench-work logs 2>/dev/null
touch "$BENCH_OUT/DONE"
