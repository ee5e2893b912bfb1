#!/usr/bin/env bash
# Set up .venv, then serve a tiny generated MoE model with `vllm serve --quantization
# kt-hybrid` (half of each layer's experts on the CPU via kt-kernel) and ask it one
# chat question through the OpenAI client. Extra arguments go to `vllm-kt demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${VENV:-.venv}/bin/vllm-kt" demo "$@"
