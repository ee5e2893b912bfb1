#!/usr/bin/env bash
# The 2026-12-06 H200 sitting (issues 27 and 28), as run: one 30-minute host, so one method
# (AMXINT4), 32-token decode runs, one prefetch point and sglang-kt's package set carried
# beside the first stages. Run detached from a copy of the repo on the host, after
# ../shared/gpu-host/README.md's vLLM bundle (and benchmarks/sglang-bundle.sh's parts):
#   setsid nohup bash benchmarks/sittings/2026-12-06-head-to-head.sh > /root/sitting.log 2>&1 &
set -u
export METHODS=AMXINT4 BENCH_ARGS="--decode-tokens 32" BENCH_JSON=h200_h2h_qwen3_30b_a3b.json
# 1. AMX experts, bare kt-kernel's sweep, kt-hybrid (GPU prefill auto = the split) on the sampled workload
STAGES="prepare bench" BENCH_SYSTEMS=kt-hybrid PREFILL_OFF_CHECK=0 BENCH_VARIANTS=" " BENCH_RUN_ARGS="--skip-layer" \
    bash benchmarks/run_h200.sh
# 2. the split's per-layer curve; vLLM's expert offloaders; sglang-kt (GPU prefill at 4,096 tokens, then off)
#    and kt-hybrid through their servers
KERNEL_SWEEP=0 STAGES="split-curve peers server-engine" PEER_SYSTEMS=vllm-offload-experts,vllm-prefetch \
    PREFETCH_SWEEP=48:1 SGLANG_PYTHON=/root/sglsite/python SGLANG_SWEEP=4096:0,0:0 \
    SERVER_ENGINE_SYSTEMS=sglang-kt,kt-hybrid bash benchmarks/run_h200.sh
echo "SITTING DONE"
