#!/usr/bin/env bash
# `vllm-kt check-models` on the GPU host with vLLM's CUDA build (both sides: plain vLLM on the
# GPU, kt-hybrid with half of every MoE layer's experts on kt-kernel), for architectures that
# vLLM's CPU build cannot run at all (sparse MLA, Triton-only attention metadata, torchvision).
# First, one part a call: bash .gpubundle/install-part.sh (../shared/gpu-host/README.md). Models
# are written on a dev box and carried (.gpubundle/models, found by their recipe's hash):
#   OUT_JSON=$OUT/model-check.json bash benchmarks/sittings/model-check-cuda.sh ARCH [ARCH ...]
set -euo pipefail
. /root/gpusite/env.sh
# sparse MLA (GLM-5, DeepSeek-V3.2) and DeepSeek-V4 need benchmarks/sparse-attention-bundle.sh's packages
if [ -f /root/dsasite/env.sh ]; then . /root/dsasite/env.sh; fi
# its own target: pip --target leaves out scripts where the bin/ folder exists already
rm -rf /root/ktsite && python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /root/ktsite . >/dev/null
export PYTHONPATH=/root/ktsite:$PYTHONPATH PATH=/root/ktsite/bin:$PATH
exec vllm-kt check-models "$@" --models "${MODELS:-.gpubundle/models}" --logs "${LOGS:-/root/model-check-logs}" \
    --out "${OUT_JSON:-/root/model-check.json}"
