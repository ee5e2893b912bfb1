#!/usr/bin/env bash
# The head-to-head sitting (issues 37 and 38): kt-hybrid against KTransformers' sglang-kt, and
# kt-hybrid's prefill against its own copy bound, on one lent GPU host of 30 minutes.
#
# On the host, from a copy of the repo (the call's checkout is replaced by every later call):
#   cp -a . /root/main && cd /root/main && VLLM_KT_COMMIT=<sha> \
#     setsid nohup bash benchmarks/sittings/head-to-head.sh > /root/sitting.log 2>&1 < /dev/null &
# after vLLM's bundle is installed (../shared/gpu-host/README.md), while sglang-kt's parts are
# still being carried (benchmarks/sglang-bundle.sh: bash .sglbundle/install-part.sh per part).
# Every later call copies what exists out: bash benchmarks/sittings/collect.sh (to $OUT).
# docs/benchmarks.md, *The head-to-head sitting*, has the calls, in order, and the timings.
#
# Stages, most wanted first (the host is taken back at 30 minutes, whatever runs):
#   1. AMXINT4 experts, quantized once without the GPU (kt-hybrid's cache; sglang-kt reads them too)
#   2. kt-hybrid behind `vllm serve`: decode at batch 1 and 16 (5 repeats each), 8 x 1,024, one 1,024
#      alone (time to first token), one 16K prompt, with the per-forward timeline; then the load,
#      1,000 requests at concurrency 64, against the same server; then all of it again behind
#      kt-hybrid's scheduler (--gather-check: 8 prompts sent together in one forward, issue 45)
#   3. the FP8 host copy's accuracy beside the CPU methods' (GPU tests, tiny models), while
#      sglang-kt's package set is installed (nothing is timed meanwhile)
#   4. sglang-kt behind its own server, the same workload and load: KTransformers' documented
#      point for Qwen3-30B-A3B first, then kt-hybrid's settings mirrored (docs/benchmarks.md)
#   5. vLLM's expert-only UVA offloader, engine mode, a decode it can finish
#   6. bare kt-kernel through every layer (the kernel sweep)
# A dry run on vLLM's CPU build (the plumbing, not the figures): BENCH_OUT=/tmp/h2h-dry H2H_LOAD=40:8
#   BENCH_ARGS="--model <a tiny model> --kt-env KT_NUM_GPU_EXPERTS=4 --cpuinfer 1" PATH=.venv/bin:$PATH bash ...
# Each stage writes its JSON under $BENCH_OUT as soon as each system ends; the host's memory
# bandwidth (kt-kernel's thread count) and the decode limit it implies are in every JSON. Both
# servers get 16,384-token prefill chunks where they take one: kt-hybrid's --max-num-batched-tokens
# (a forward that streams the CPU experts pays one copy of them, whatever its size), and the
# mirror point's --chunked-prefill-size; the documented point keeps its 4,096.
set -u
cd "$(dirname "$0")/../.."
export BENCH_OUT=${BENCH_OUT:-/root/bench-out}
export METHODS=AMXINT4
export SGLANG_PYTHON=${SGLANG_PYTHON:-/root/sglsite/python}
mkdir -p "$BENCH_OUT"
# Everything this sitting starts inherits its tag: benchmarks/sittings/stop.sh stops it all by the tag
export VLLM_KT_SITTING=${VLLM_KT_SITTING:-sitting-$(date +%s)-$$}
echo "$VLLM_KT_SITTING" > "$BENCH_OUT/sitting.tag"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1 | grep -o 'H[0-9]\+' | head -1 | tr 'H' 'h')  # H100 80GB HBM3 -> h100
SERVER_JSON=${card:-gpu}_h2h_server_qwen3_30b_a3b.json
ENGINE_JSON=${card:-gpu}_h2h_engine_qwen3_30b_a3b.json
# 16-token decode runs (pairs of 16 and 32 new tokens): five pairs at batch 16 take about a
# minute on the H100; the sitting's figures are medians of five.
export BENCH_ARGS="--decode-tokens 16 --decode-repeats 5 ${BENCH_ARGS:-}"
stage() { echo "$(date +%T) SITTING $*" | tee -a "$BENCH_OUT/stages.log"; }

# Nothing of a system may outlive it (the bench kills each one's process group and checks the
# GPU's memory); this says so in the log, and clears what a crash left, before the next stage.
leftovers() {
  local apps
  apps=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2> /dev/null)
  if [ -n "$apps" ]; then
    stage "LEFTOVER GPU processes after $1: $apps (killed)"
    echo "$apps" | cut -d, -f1 | xargs -r kill -9 2> /dev/null
    sleep 3
  fi
}

# H2H_FROM=N resumes a sitting from stage N on a host that kept what the earlier ones made
# (after benchmarks/sittings/stop.sh, which stops the sitting by its tag)
from() { [ "${H2H_FROM:-1}" -le "$1" ]; }

if from 1; then
  stage "1 prepare (AMXINT4 experts, no GPU)"
  STAGES=prepare bash benchmarks/run_h200.sh
  leftovers prepare
fi

from 2 && {
stage "2 kt-hybrid behind vllm serve: decode, prefills, timeline, load"
KERNEL_SWEEP=0 STAGES=server-engine SERVER_ENGINE_SYSTEMS=kt-hybrid SERVER_LOAD=${H2H_LOAD:-1000:64} \
  SERVER_ENGINE_ARGS="--max-num-batched-tokens 16384 --gather-check" SERVER_ENGINE_JSON=$SERVER_JSON \
  bash benchmarks/run_h200.sh
leftovers kt-hybrid
# The FP8 host copy (on by default for AMXINT4 on this GPU) has never served on a GPU before this
# sitting: where kt-hybrid's server failed, it runs again with the exact copy (its env says so).
if python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['server_engine']['runs']; sys.exit(not any('error' in x for x in r))" \
    "$BENCH_OUT/$SERVER_JSON" 2> /dev/null; then
  stage "2b kt-hybrid failed: again with KT_STAGING_FP8_COPY=0"
  KERNEL_SWEEP=0 STAGES=server-engine SERVER_ENGINE_SYSTEMS=kt-hybrid SERVER_LOAD=${H2H_LOAD:-1000:64} \
    SERVER_ENGINE_ARGS="--append --max-num-batched-tokens 16384 --kt-env KT_STAGING_FP8_COPY=0" \
    SERVER_ENGINE_JSON=$SERVER_JSON bash benchmarks/run_h200.sh
  leftovers kt-hybrid-exact-copy
fi
}

from 3 && {
stage "3 GPU accuracy tests beside sglang-kt's install and check"
GPU_TEST_FILES=tests/engine/test_gpu.py GPU_TESTS=fp8_copy_drift GPU_TESTS_TIMEOUT=${ACCURACY_TIMEOUT_S:-300} \
  GPU_TESTS_JSON=${card:-gpu}_fp8_copy_accuracy.json STAGES=gpu-tests bash benchmarks/run_h200.sh &
tests=$!
# install-part.sh --install waits for the last part (SGLANG_WAIT_S); the check writes sglang-check.failed
# on failure, and the later stages then leave sglang-kt out, saying why (run_h200.sh's without_sglang)
GPU_FREE_WAIT_S=0 SGLANG_WAIT_S=${SGLANG_WAIT_S:-900} STAGES="sglang-install sglang-check" bash benchmarks/run_h200.sh
wait $tests
leftovers gpu-tests
}

from 4 && {
stage "4 sglang-kt behind its own server: the documented point, then the mirror of kt-hybrid's; the load"
KERNEL_SWEEP=0 STAGES=server-engine SERVER_ENGINE_SYSTEMS=sglang-kt SERVER_LOAD=${H2H_LOAD:-1000:64} \
  SGLANG_SWEEP=${SGLANG_POINTS:-documented,mirror} SERVER_ENGINE_ARGS="--append --max-num-batched-tokens 16384" \
  SERVER_ENGINE_JSON=$SERVER_JSON bash benchmarks/run_h200.sh
leftovers sglang-kt
}

from 5 && {
stage "5 vLLM's expert-only offloader, engine mode"
KERNEL_SWEEP=0 STAGES=peers PEER_SYSTEMS=vllm-offload-experts BENCH_ARGS="$BENCH_ARGS --decode-tokens 8 --decode-repeats 3" \
  BENCH_JSON=$ENGINE_JSON bash benchmarks/run_h200.sh
leftovers offloader
}

stage "6 the kernel sweep"
STAGES=sweep BENCH_JSON=$ENGINE_JSON bash benchmarks/run_h200.sh
stage "DONE"
