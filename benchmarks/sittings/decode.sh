#!/usr/bin/env bash
# The decode sitting (issue 44): kt-hybrid behind `vllm serve`, decode at batch 1 and 16 with the
# per-step decode timeline, at KT_CPUINFER 14, 12 and 10 and with KT_VLLM_CORES shared or free, on
# one lent GPU host of 30 minutes (Qwen3-30B-A3B shape, AMXINT4, sampled decoding, 7 repeats).
#
# On the host, after vLLM's bundle is installed (../shared/gpu-host/README.md), from a copy of the repo:
#   rm -rf /root/main && cp -a . /root/main && cd /root/main && \
#     VLLM_KT_COMMIT=<sha> setsid nohup bash benchmarks/sittings/decode.sh > /root/sitting.log 2>&1 < /dev/null &
# then every later call: sleep 240; bash /root/main/benchmarks/sittings/collect.sh (copies out to $OUT).
#
# Stages, most wanted first (the host is taken back at 30 minutes, whatever runs):
#   1. AMXINT4 experts, quantized once without the GPU
#   2. one `vllm-kt bench --server-engine --decode-timeline` call: bare kt-kernel through every layer
#      (the kernel sweep), then a server per point, each saved to the JSON as it ends: 14 threads
#      (the default on 16 cores), 12, 14 with vLLM's threads off kt-kernel's cores (KT_VLLM_CORES=free),
#      10, 12 free, 14 without the timeline's stamps (their cost), and 14 with kt-kernel's own phase
#      timing in its log (KT_MOE_PHASE_TIMING)
# A dry run on vLLM's CPU build (the plumbing, not the figures): BENCH_OUT=/tmp/decode-dry
#   BENCH_ARGS="--model <a tiny model> --kt-env KT_NUM_GPU_EXPERTS=4 --cpuinfer 1" DECODE_POINTS="t1-free:KT_VLLM_CORES=free"
#   METHODS=BF16 (where the CPU has no AMX)
#   PATH=.venv/bin:$PATH bash benchmarks/sittings/decode.sh
set -u
cd "$(dirname "$0")/../.."
export BENCH_OUT=${BENCH_OUT:-/root/bench-out}
export METHODS=${METHODS:-AMXINT4}
mkdir -p "$BENCH_OUT"
# Everything this sitting starts inherits its tag: benchmarks/sittings/stop.sh stops it all by the tag
export VLLM_KT_SITTING=${VLLM_KT_SITTING:-sitting-$(date +%s)-$$}
echo "$VLLM_KT_SITTING" > "$BENCH_OUT/sitting.tag"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1 | grep -o 'H[0-9]\+' | head -1 | tr 'H' 'h')
JSON=${card:-cpu}_decode_threads_qwen3_30b_a3b.json
export BENCH_ARGS="--decode-tokens 16 --decode-repeats 7 ${BENCH_ARGS:-}"
stage() { echo "$(date +%T) SITTING $*" | tee -a "$BENCH_OUT/stages.log"; }

# The points after the default run (14 threads on 16 cores, the timeline armed), in order of value.
POINTS=${DECODE_POINTS:-"t12:KT_CPUINFER=12 t14-free:KT_VLLM_CORES=free t10:KT_CPUINFER=10 \
t12-free:KT_CPUINFER=12,KT_VLLM_CORES=free t14-unstamped:VLLM_KT_DECODE_TIMELINE=0 \
t14-phases:KT_MOE_PHASE_TIMING=1,KT_MOE_PHASE_TIMING_INTERVAL=4800"}
variants=()
for point in $POINTS; do variants+=(--variant "$point"); done

stage "1 prepare (AMXINT4 experts, no GPU)"
STAGES=prepare bash benchmarks/run_h200.sh

stage "2 kt-hybrid behind vllm serve: decode with its timeline, threads and cores"
STAGES=server-engine SERVER_ENGINE_SYSTEMS=kt-hybrid SERVER_ENGINE_JSON=$JSON \
  SERVER_ENGINE_ARGS="--max-num-batched-tokens 16384 --decode-timeline ${variants[*]}" bash benchmarks/run_h200.sh
stage "DONE"
echo "SITTING DONE"
