#!/usr/bin/env bash
# One H200 sitting: GPU tests, the engine benchmark and the load benchmark, whose JSON/PNG
# are committed under benchmarks/results/. Run from the repo root on a GPU host prepared
# as in ../shared/gpu-host/README.md (vLLM 0.32 + kt-kernel in /root/gpusite), detached:
#   setsid nohup bash benchmarks/run_h200.sh &
# STAGES picks what runs (default: all, in this order); GPU_TEST_FILES and GPU_TESTS (pytest's
# -k filter) pick the GPU tests, GPU_TESTS_TIMEOUT caps them (s); LOAD_SYSTEMS the load stage's systems;
# BENCH_ARGS extra arguments for every `vllm-kt bench` (e.g. "--gpu-memory-utilization 0.5");
# BENCH_VARIANTS the bench stage's extra runs of its first method (NAME:KT_A=1[,KT_B=2] each).
# Everything goes to $BENCH_OUT; stages.log says where it is, DONE marks the end.
set -uo pipefail
BENCH_OUT=${BENCH_OUT:-/root/bench-out}
STAGES=${STAGES:-"layer gpu-tests restart-test bench load fp8-bench"}
mkdir -p "$BENCH_OUT"
[ -f /root/gpusite/env.sh ] && source /root/gpusite/env.sh
# Ray, for the several-hosts test, installed apart (see benchmarks/ray-bundle.sh)
[ -d /root/raysite ] && export PYTHONPATH=/root/raysite:$PYTHONPATH PATH=/root/raysite/bin:$PATH
export PYTHONUNBUFFERED=1
export VLLM_KT_TEST_MODEL_CACHE=${VLLM_KT_TEST_MODEL_CACHE:-/root/tiny-models}
stage() { echo "$(date +%T) $*" | tee -a "$BENCH_OUT/stages.log"; }
wants() { [[ " $STAGES " == *" $1 "* ]]; }
# shellcheck disable=SC2206 - BENCH_ARGS is a list of arguments
BENCH=(python3 -m vllm_kt_plugin.cli.main bench --shape qwen3-30b-a3b --gpu-weight-gb 17 --workdir /root/bench-work
       ${BENCH_ARGS:-})

stage "install"
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /root/gpusite . \
    > "$BENCH_OUT/install.log" 2>&1 || python3 -m pip install -q --no-deps -e . >> "$BENCH_OUT/install.log" 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$BENCH_OUT/host.txt" 2>&1
lscpu >> "$BENCH_OUT/host.txt" 2>&1

if wants layer; then  # one layer alone: CPU path vs GPU prefill (copy, compute), decode overhead
  stage "layer"
  "${BENCH[@]}" --systems kt-hybrid --methods "${METHODS:-AMXINT4}" --layer-only \
      --out "$BENCH_OUT/h200_layer_qwen3_30b_a3b.json" > "$BENCH_OUT/layer.log" 2>&1
  stage "layer exit $?"
fi

if wants gpu-tests; then
  stage "gpu tests"
  # shellcheck disable=SC2086 - GPU_TEST_FILES is a list of paths
  timeout "${GPU_TESTS_TIMEOUT:-1800}" python3 -m pytest -m gpu ${GPU_TEST_FILES:-tests/engine/test_gpu.py \
      tests/engine/test_ray_gpu.py tests/engine/test_quantized_gpu.py} -k "${GPU_TESTS:-}" -v -s -rs \
      -p no:cacheprovider > "$BENCH_OUT/gpu-tests.log" 2>&1
  stage "gpu tests exit $?"
fi

if wants restart-test; then  # needs AMX kernels, which CI's CPUs lack
  stage "restart test"
  python3 -m pytest tests/engine/test_restarts.py -v -s -rs -p no:cacheprovider > "$BENCH_OUT/restart-test.log" 2>&1
  stage "restart test exit $?"
fi

if wants bench; then
  stage "bench"
  SKIP_LAYER=(); wants layer && SKIP_LAYER=(--skip-layer)  # timed alone above
  VARIANTS=()  # more runs of the first method: deferral, and per-layer timings inside the graphs
  for v in ${BENCH_VARIANTS:-defer-1:KT_MAX_DEFERRED_EXPERTS_PER_TOKEN=1 defer-2:KT_MAX_DEFERRED_EXPERTS_PER_TOKEN=2 \
             metrics:KT_METRICS_INTERVAL=2}; do VARIANTS+=(--variant "$v"); done
  "${BENCH[@]}" --methods "${METHODS:-AMXINT4,AMXINT8}" --prefill-off-check "${VARIANTS[@]}" "${SKIP_LAYER[@]}" \
      --out "$BENCH_OUT/h200_qwen3_30b_a3b.json" > "$BENCH_OUT/bench.log" 2>&1
  stage "bench exit $?"
fi

if wants load; then  # every system behind `vllm serve` under `vllm bench serve`
  stage "load bench"
  "${BENCH[@]}" --methods AMXINT4 --systems "${LOAD_SYSTEMS:-vllm-gpu,vllm-offload,kt-hybrid}" \
      --load 1000:64 --offload-load "${OFFLOAD_LOAD:-200:64}" \
      --load-input-len 128 --load-output-len 16 \
      --out "$BENCH_OUT/h200_load_qwen3_30b_a3b.json" > "$BENCH_OUT/load-bench.log" 2>&1
  stage "load bench exit $?"
fi
if wants fp8-bench; then  # the block-FP8 checkpoint: FP8 on the GPU everywhere, kt-kernel FP8 on the CPU
  stage "fp8 bench"
  "${BENCH[@]}" --checkpoint fp8-block --gpu-weight-gb "${FP8_GPU_WEIGHT_GB:-9}" --layers "${FP8_LAYERS:-0}" \
      --systems "${FP8_SYSTEMS:-kt-hybrid,vllm-gpu,vllm-offload}" \
      --skip-layer --out "$BENCH_OUT/h200_fp8_qwen3_30b_a3b.json" > "$BENCH_OUT/fp8-bench.log" 2>&1
  stage "fp8 bench exit $?"
fi
tar czf "$BENCH_OUT/bench-logs.tgz" -C /root/bench-work logs 2>/dev/null
touch "$BENCH_OUT/DONE"
