#!/usr/bin/env bash
# Stop a detached sitting whole: its driver, run_h200.sh, the bench and every server or engine
# it started (their GPU memory back), e.g. to resume it with H2H_FROM after a fix.
for p in $(pgrep -f "sittings/head-to-head.sh|benchmarks/run_h200.sh|vllm_kt_tools.cli.main bench|vllm serve|VLLM::|sglang.launch_server|multiprocessing.spawn"); do
  [ "$p" = $$ ] || [ "$p" = "$PPID" ] || kill -9 "$p" 2> /dev/null
done
sleep 4
nvidia-smi --query-gpu=memory.used --format=csv,noheader 2> /dev/null | sed 's/^/stop: GPU memory used /'
