#!/usr/bin/env bash
# A head-to-head sitting (issues 27 and 28) for a host with about 17 minutes of device time
# left after the vLLM bundle: one method (AMXINT4), 16-token decode runs, and the most wanted
# figures first in case the host is taken back. Planned 2026-12-06, when no host could be
# started: it has not run yet (its split-curve stage ran alone on an H100 later that day:
# docs/split.md). Left out, for lack of time: vLLM's prefetch offloader (at
# 17 GiB it streams 37 layers' experts, ~42 GB, per step: about 0.8 s a step by the copy
# bound, so its decode runs alone would take ~10 minutes), `--cpu-offload-gb` without
# `--cpu-offload-params` (dominated by the expert-only one) and sglang-kt (85 bundle parts:
# ~7 minutes of carrying at 2026-12-06's 4.7 s a part; docs/benchmarks.md's sitting 4 runs it).
# Run detached from a copy of the repo on a host prepared as ../shared/gpu-host/README.md says:
#   setsid nohup bash benchmarks/sittings/head-to-head-short.sh > /root/sitting.log 2>&1 &
set -u
export METHODS=AMXINT4 BENCH_ARGS="--decode-tokens 16" BENCH_JSON=h200_h2h_qwen3_30b_a3b.json
# 1. AMX experts; bare kt-kernel's sweep; kt-hybrid (GPU prefill auto = the split) on the sampled workload
STAGES="prepare bench" BENCH_SYSTEMS=kt-hybrid PREFILL_OFF_CHECK=0 BENCH_VARIANTS=" " BENCH_RUN_ARGS="--skip-layer" \
    bash benchmarks/run_h200.sh
# 2. the split's per-layer curve, 128 to 16,384 tokens (BF16 and FP8 host copies)
STAGES="split-curve" bash benchmarks/run_h200.sh
# 3. vLLM's expert-only UVA offloader at the same GPU weight memory, appended to the same JSON
KERNEL_SWEEP=0 STAGES="peers" PEER_SYSTEMS=vllm-offload-experts bash benchmarks/run_h200.sh
echo "SITTING DONE"
