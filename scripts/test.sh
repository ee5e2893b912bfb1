#!/usr/bin/env bash
# Set up .venv, lint, then run the whole test suite (unit tests and end-to-end tests with
# real vLLM engines; ~35-45 min on 2 CPU cores). Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m "not engine"` for the fast unit tests only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check vllm_kt_plugin vllm_kt_tools tests configs
exec "$VENV/bin/python" -m pytest -v -rs --durations=60 "$@"
