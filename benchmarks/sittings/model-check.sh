#!/usr/bin/env bash
# `vllm-kt check-models` on the GPU host's CPU cores (AVX-512, AMX) with vLLM's CPU build, for the
# architectures the AVX2 dev box and CI cannot check (docs/supported_models.md says which run
# each row comes from). First, one part a call: bash .gpubundle/cpu/cpu-build-bundle.sh install
# (benchmarks/cpu-build-bundle.sh). Then, from a copy of the checkout on the host:
#   MODELS=/root/models bash benchmarks/sittings/model-check.sh ARCH [ARCH ...]
# Models missing from $MODELS are written there first (tiny, as on any machine).
set -euo pipefail
. /root/cpusite/env.sh
# its own target: pip --target leaves out scripts where the bin/ folder exists already
rm -rf /root/ktsite && python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /root/ktsite . >/dev/null
export PYTHONPATH=/root/ktsite:$PYTHONPATH PATH=/root/ktsite/bin:$PATH
exec vllm-kt check-models "$@" --models "${MODELS:-/root/models}" --logs /root/model-check-logs \
    --out "${OUT_JSON:-/root/model-check.json}"
