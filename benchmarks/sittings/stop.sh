#!/usr/bin/env bash
# Stop a detached sitting whole, e.g. to resume it with H2H_FROM after a fix: every process that
# carries its tag (VLLM_KT_SITTING, exported by the sitting and inherited by everything it starts,
# the systems' own sessions and an engine child early in its start included) and the rest of each
# of their sessions. Processes are found by that tag, not by names: a shell whose command line
# names a sitting script is not touched. BENCH_OUT (/root/bench-out) holds the tag (sitting.tag).
set -u
B=${BENCH_OUT:-/root/bench-out}
tag=$(cat "$B/sitting.tag" 2> /dev/null)
if [ -z "$tag" ]; then
  echo "stop: no $B/sitting.tag: no sitting started there" >&2
  exit 1
fi
PYTHONPATH="$(cd "$(dirname "$0")/../.." && pwd)" python3 -m vllm_kt_tools.support.process_groups "$tag"
sleep 2
nvidia-smi --query-gpu=memory.used --format=csv,noheader 2> /dev/null | sed 's/^/stop: GPU memory used /'
