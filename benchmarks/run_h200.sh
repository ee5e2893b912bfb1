#!/usr/bin/env bash
# The H200 sitting: GPU tests, then the benchmark whose JSON/PNG are committed under
# benchmarks/results/. Run from the repo root on a GPU host prepared as in
# ../shared/gpu-host/README.md (vLLM 0.32 + kt-kernel in /root/gpusite). It can run
# detached (`setsid nohup bash benchmarks/run_h200.sh &`): everything goes to $BENCH_OUT.
set -uo pipefail
BENCH_OUT=${BENCH_OUT:-/root/bench-out}
mkdir -p "$BENCH_OUT"
[ -f /root/gpusite/env.sh ] && source /root/gpusite/env.sh
export PYTHONUNBUFFERED=1
export VLLM_KT_TEST_MODEL_CACHE=${VLLM_KT_TEST_MODEL_CACHE:-/root/gpucarry/tiny-models}
stage() { echo "$(date +%T) $*" | tee -a "$BENCH_OUT/stages.log"; }

stage "install"
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /root/gpusite . \
    > "$BENCH_OUT/install.log" 2>&1 || python3 -m pip install -q --no-deps -e . >> "$BENCH_OUT/install.log" 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$BENCH_OUT/host.txt" 2>&1
lscpu >> "$BENCH_OUT/host.txt" 2>&1

if [ -z "${SKIP_GPU_TESTS:-}" ]; then
  stage "gpu tests"
  python3 -m pytest -m gpu tests/engine/test_gpu.py -v -rs -p no:cacheprovider > "$BENCH_OUT/gpu-tests.log" 2>&1
  stage "gpu tests exit $?"
fi

stage "bench"
python3 -m vllm_kt_plugin.cli.main bench --shape qwen3-30b-a3b --gpu-weight-gb 17 --methods AMXINT4,AMXINT8 \
    --workdir /root/bench-work --out "$BENCH_OUT/h200_qwen3_30b_a3b.json" > "$BENCH_OUT/bench.log" 2>&1
stage "bench exit $?"
tar czf "$BENCH_OUT/bench-logs.tgz" -C /root/bench-work logs 2>/dev/null
touch "$BENCH_OUT/DONE"
