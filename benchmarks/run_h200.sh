#!/usr/bin/env bash
# One H200 sitting: GPU tests, the engine benchmark and the load benchmark, whose JSON/PNG
# are committed under benchmarks/results/. Run from the repo root on a GPU host prepared
# as in ../shared/gpu-host/README.md (vLLM 0.32 + kt-kernel in /root/gpusite), detached:
#   setsid nohup bash benchmarks/run_h200.sh &
# STAGES picks what runs, in order (default below). A stage written NAME& runs in the
# background while the next ones go on; "wait" waits for those. Only CPU work belongs beside
# the GPU's: e.g. STAGES="prepare& gpu-tests wait bench". Engines side by side take turns to
# start and stop (VLLM_KT_ENGINE_LOCK: vLLM's profiling counts memory other processes take or
# free meanwhile), but nothing is timed beside anything (plain vLLM's batch-1 decode beside
# tiny test engines gave 714, 310 and 243 tok/s in three repeats), and kt-kernel pins its
# threads to cores 0..n-1 whatever the affinity.
#   prepare       online-quantized AMX experts of METHODS, made without the GPU
#   prepare-fp8   fp8-bench's FP8 expert files, written without the GPU
#   oversub       kt_oversubscription.py: kt-kernel workers beside busy processes, per
#                 OVERSUB_RUNS "threads:busy ...", alone on the host -> oversubscription.jsonl
#   layer         one layer alone: CPU path vs GPU prefill (copy, compute), decode overhead
#   split-curve   issue 28's per-layer curve, 128 to 16,384 tokens: CPU path, whole-layer stream, split,
#                 split with the FP8 host copy (first of METHODS) -> SPLIT_JSON
#   layer-dynamic one layer of BF16 experts with KT_DYNAMIC_GPU_EXPERTS: a swap's cost
#   prepare-dynamic  dynamic-bench's BF16 expert files (DYNAMIC_LAYERS layers), written without the GPU
#   dynamic-bench kt-hybrid on BF16 experts (DYNAMIC_LAYERS layers, 1.2 GB of files each; DYNAMIC_GPU_EXPERTS
#                 per layer; GPU prefill off in both), static placement vs KT_DYNAMIC_GPU_EXPERTS=1 -> DYNAMIC_JSON;
#                 DYNAMIC_DECODE_TOKENS (128) replaces BENCH_ARGS' --decode-tokens there
#   gpu-tests     GPU_TEST_FILES with pytest -k GPU_TESTS, capped at GPU_TESTS_TIMEOUT s -> GPU_TESTS_JSON
#                 (h200_gpu_tests.json: each test's id, outcome and printed drift, from the JUnit XML)
#   restart-test  needs AMX kernels, which CI's CPUs lack
#   bench         BENCH_SYSTEMS x METHODS, then the first method with GPU prefill off (unless
#                 PREFILL_OFF_CHECK=0) and with BENCH_VARIANTS (NAME:KT_A=1[,KT_B=2] each) -> BENCH_JSON
#   peers         issue 27's peers at the same 17 GiB: PEER_SYSTEMS (vllm-offload-experts, the prefetch
#                 offloader's sweep PREFETCH_SWEEP) -> --append to BENCH_JSON; its prefetch_sweep.chosen
#                 names the point for the load stage (PREFETCH_POINT=GROUP:STEP)
#   (bench and load time bare kt-kernel first, --kernel-sweep, unless KERNEL_SWEEP=0)
#   sweep         that kernel sweep alone, appended to BENCH_JSON
#   load          LOAD_SYSTEMS behind `vllm serve` under `vllm bench serve`, 1000 requests at 64 each
#                 (OFFLOAD_LOAD=N:C: fewer for vLLM's offloaders; sglang-kt: its own server under
#                 SGLANG_PYTHON, from benchmarks/sglang-bundle.sh, reading the AMX experts `prepare` made)
#   server-engine the engine workload (decode at batch 1 and 16, 8 x 1,024, one 16K prompt) through each of
#                 SERVER_ENGINE_SYSTEMS' servers (kt-hybrid behind `vllm serve`, sglang-kt behind its own under
#                 SGLANG_PYTHON): sglang-kt's only way to those figures -> SERVER_ENGINE_JSON
#   sglang-install  installs sglang-kt's package set from the parts carried so far (bash .sglbundle/install-part.sh
#                 per part, which only stores them): waits up to SGLANG_WAIT_S for the last, verifies, unpacks and
#                 installs into /root/sglsite (~10 GB of files: a quiet moment, never beside a timed stage)
#   sglang-check  imports what sglang-kt's server imports under SGLANG_PYTHON, loads sgl_kernel's sm90 ops, prints
#                 the versions (vllm_kt_tools/bench/sglang_check.py); on failure its one line goes to stages.log and
#                 the later stages of this BENCH_OUT drop sglang-kt from their systems (sglang-check.failed)
#   fp8-bench     the block-FP8 checkpoint (FP8_LAYERS layers, FP8_GPU_WEIGHT_GB): FP8_SYSTEMS,
#                 FP8_BENCH_ARGS added; DeepGEMM's warm-up skipped (FP8_DEEP_GEMM_WARMUP, see below)
#   prefill-test  GPU prefill with kt-kernel's BF16 write-back, on against off (test_gpu.py)
# The lent host goes back after ~30 s without a command (a second sitting of 2026-12-04 lost its
# first 9 minutes so): poll with commands that wait on the host (`sleep 120; tail ...`), back to back.
# BENCH_ARGS: extra arguments for every `vllm-kt bench` (BENCH_RUN_ARGS: the bench stage's only). Everything goes to $BENCH_OUT;
# stages.log says when each stage started and ended, DONE marks the end. Before each stage the GPU's memory
# must have come back (at most 2 GiB in use, nvidia-smi): a stage that starts beside leftovers gets a "GPU not
# free" line naming them; the bench itself stops, naming them, before any system would start beside them, and stops the whole
# process group of every system it started when it ends or is stopped (SIGTERM/SIGINT). The host can be
# taken back mid-sitting: let every poll copy $BENCH_OUT's JSON and logs to $OUT, and finish
# a cut sitting later with the missing systems and --append. Block-FP8 engines JIT-compile
# ~800 DeepGEMM kernels at their first start on a host (2-3 minutes; cached after) with
# vLLM's default warm-up; fp8-bench skips it (VLLM_DEEP_GEMM_WARMUP=skip, recorded in the
# JSON's host.vllm_env: kernels compile on first use, mostly in the untimed warm-ups, but the
# 2026-12-04 sitting saw one land in a timed repeat; FP8_DEEP_GEMM_WARMUP=relax restores it).
set -uo pipefail
BENCH_OUT=${BENCH_OUT:-/root/bench-out}
STAGES=${STAGES:-"layer gpu-tests restart-test bench load fp8-bench"}
mkdir -p "$BENCH_OUT"
# Everything this sitting starts inherits its tag: benchmarks/sittings/stop.sh stops it all by the tag
export VLLM_KT_SITTING=${VLLM_KT_SITTING:-sitting-$(date +%s)-$$}
echo "$VLLM_KT_SITTING" > "$BENCH_OUT/sitting.tag"
[ -f /root/gpusite/env.sh ] && source /root/gpusite/env.sh
# Ray, for the several-hosts test, installed apart (see benchmarks/ray-bundle.sh)
[ -d /root/raysite ] && export PYTHONPATH=/root/raysite:$PYTHONPATH PATH=/root/raysite/bin:$PATH
export PYTHONUNBUFFERED=1
# vLLM 0.32 cannot load its AOT compile cache back on torch 2.13 and compiles every engine again;
# its older cache loads (docs/contributing.md, *Tests*). Startup only; recorded in the JSON's host.vllm_env.
export VLLM_USE_AOT_COMPILE=${VLLM_USE_AOT_COMPILE:-0}
export VLLM_KT_TEST_MODEL_CACHE=${VLLM_KT_TEST_MODEL_CACHE:-/root/tiny-models}
export VLLM_KT_ENGINE_LOCK=${VLLM_KT_ENGINE_LOCK:-$BENCH_OUT/engine.lock}
# the commit every JSON's host records (the tree may arrive without .git: set it when carrying)
export VLLM_KT_COMMIT=${VLLM_KT_COMMIT:-$(git rev-parse HEAD 2> /dev/null)}
stage() { echo "$(date +%T) $*" | tee -a "$BENCH_OUT/stages.log"; }
wants() { [[ " ${STAGES//&/} " == *" $1 "* ]]; }
# shellcheck disable=SC2206 - BENCH_ARGS is a list of arguments
BENCH=(python3 -m vllm_kt_tools.cli.main bench --shape qwen3-30b-a3b --gpu-weight-gb 17 --workdir /root/bench-work
       ${BENCH_ARGS:-})
# Every engine or load sitting times bare kt-kernel first (--kernel-sweep): host speed beside its figures
SWEEP=(--kernel-sweep)
[ "${KERNEL_SWEEP:-1}" = 0 ] && SWEEP=()
# SGLANG_SWEEP=1: sglang-kt's points documented,mirror (docs/benchmarks.md); SGLANG_SWEEP=NAME|T:D[,...]: these, in order
SGLANG=()
[ -n "${SGLANG_SWEEP:-}" ] && SGLANG=(--sglang-sweep) && [ "$SGLANG_SWEEP" != 1 ] && SGLANG+=("$SGLANG_SWEEP")
FP8=("${BENCH[@]}" --checkpoint fp8-block --gpu-weight-gb "${FP8_GPU_WEIGHT_GB:-9}" --layers "${FP8_LAYERS:-0}"
     --skip-layer --out "$BENCH_OUT/h200_fp8_qwen3_30b_a3b.json")

export SGLANG_PYTHON=${SGLANG_PYTHON:-/root/sglsite/python}  # sglang-kt's own interpreter (sglang-install)
SGLANG_FAILED=$BENCH_OUT/sglang-check.failed  # written by the sglang-check stage: sglang-kt cannot run here

without_sglang() {  # $1: a comma list of systems; sglang-kt left out where its check failed on this host
  local systems=$1
  if [ -f "$SGLANG_FAILED" ] && [[ ",$systems," == *",sglang-kt,"* ]]; then
    systems=$(echo ",$systems," | sed 's/,sglang-kt,/,/; s/^,//; s/,$//')
    stage "sglang-kt left out of $1: $(cat "$SGLANG_FAILED")" >&2
  fi
  echo "$systems"
}

run_sglang_install() {  # the installer travels with the parts; install-part.sh keeps a copy by them
  local installer=${SGLBUNDLE_INSTALLER:-.sglbundle/install-part.sh}
  [ -f "$installer" ] || installer=/root/sglbundle/install-part.sh
  bash "$installer" --install "${SGLANG_WAIT_S:-600}" > "$BENCH_OUT/sglang-install.log" 2>&1
  local status=$?
  stage "sglang-install: $(tail -1 "$BENCH_OUT/sglang-install.log")"
  return $status
}

run_sglang_check() {
  if [ -x "$SGLANG_PYTHON" ]; then
    "$SGLANG_PYTHON" -m vllm_kt_tools.bench.sglang_check > "$BENCH_OUT/sglang-check.log" 2>&1
  else
    echo "[sglang-check] FAILED install: no $SGLANG_PYTHON (STAGES=sglang-install, after carrying .sglbundle/)" \
        > "$BENCH_OUT/sglang-check.log"
    false
  fi
  local status=$?
  local verdict
  verdict=$(grep '^\[sglang-check\]' "$BENCH_OUT/sglang-check.log" | tail -1)
  stage "${verdict:-[sglang-check] FAILED: no verdict (see sglang-check.log)}"
  if [ $status = 0 ]; then rm -f "$SGLANG_FAILED"; else echo "${verdict:-no verdict}" > "$SGLANG_FAILED"; fi
  return $status
}

run_prepare() {  # no CUDA context: it would count against an engine profiling meanwhile
  CUDA_VISIBLE_DEVICES= "${BENCH[@]}" --systems kt-hybrid --methods "${METHODS:-AMXINT4,AMXINT8}" --prepare-only \
      > "$BENCH_OUT/prepare.log" 2>&1
}

run_prepare_fp8() {
  CUDA_VISIBLE_DEVICES= "${FP8[@]}" --systems kt-hybrid --prepare-only > "$BENCH_OUT/prepare-fp8.log" 2>&1
}

run_oversub() {
  for run in ${OVERSUB_RUNS:-14:2 14:3 12:4 12:5}; do
    python3 benchmarks/kt_oversubscription.py --threads "${run%:*}" --busy "${run#*:}" --workdir /root/bench-work/oversub \
        2>> "$BENCH_OUT/oversub.log" | grep '^{' >> "$BENCH_OUT/oversubscription.jsonl"  # kt-kernel prints too
  done
}

run_layer() {
  "${BENCH[@]}" --systems kt-hybrid --methods "${METHODS:-AMXINT4}" --layer-only \
      --out "$BENCH_OUT/h200_layer_qwen3_30b_a3b.json" > "$BENCH_OUT/layer.log" 2>&1
}

run_split_curve() {
  "${BENCH[@]}" --systems kt-hybrid --methods "${METHODS%%,*}" --layer-only --split-curve \
      --out "$BENCH_OUT/${SPLIT_JSON:-h200_split_curve_qwen3_30b_a3b.json}" > "$BENCH_OUT/split-curve.log" 2>&1
}

run_layer_dynamic() {  # one layer of BF16 experts from files (kt-kernel writes those back): swap cost
  "${BENCH[@]}" --checkpoint bf16-experts --layers 1 --systems kt-hybrid --layer-only \
      --kt-env KT_NUM_GPU_EXPERTS="${DYNAMIC_GPU_EXPERTS:-33}" --kt-env KT_DYNAMIC_GPU_EXPERTS=1 \
      --out "$BENCH_OUT/h200_dynamic_layer_qwen3_30b_a3b.json" > "$BENCH_OUT/layer-dynamic.log" 2>&1
}

# a few layers decode fast: 128 new tokens per run keep stalls small against them
DYNAMIC=("${BENCH[@]}" --checkpoint bf16-experts --layers "${DYNAMIC_LAYERS:-8}" --systems kt-hybrid --skip-layer
         --decode-tokens "${DYNAMIC_DECODE_TOKENS:-128}"
         --kt-env KT_NUM_GPU_EXPERTS="${DYNAMIC_GPU_EXPERTS:-33}" --kt-env KT_STAGING_MIN_TOKENS=0
         --out "$BENCH_OUT/${DYNAMIC_JSON:-h200_dynamic_qwen3_30b_a3b.json}")

run_prepare_dynamic() {
  CUDA_VISIBLE_DEVICES= "${DYNAMIC[@]}" --prepare-only > "$BENCH_OUT/prepare-dynamic.log" 2>&1
}

run_dynamic_bench() {  # dummy weights route almost uniformly: the traffic has little to follow
  "${DYNAMIC[@]}" --variant dynamic:KT_DYNAMIC_GPU_EXPERTS=1 > "$BENCH_OUT/dynamic-bench.log" 2>&1
}

run_gpu_tests() {  # the log, and the committed summary: ids, outcomes, the drift each test printed
  local files=${GPU_TEST_FILES:-tests/engine/test_gpu.py tests/engine/test_ray_gpu.py tests/engine/test_quantized_gpu.py}
  # shellcheck disable=SC2086 - files is a list of paths
  local command=(python3 -m pytest -m gpu $files -k "${GPU_TESTS:-}" -v -rA -p no:cacheprovider
                 --junitxml="$BENCH_OUT/gpu-tests.xml" -o junit_logging=system-out)
  timeout "${GPU_TESTS_TIMEOUT:-1800}" "${command[@]}" > "$BENCH_OUT/gpu-tests.log" 2>&1
  local status=$?
  python3 -m vllm_kt_tools.bench.pytest_summary "$BENCH_OUT/gpu-tests.xml" --command "${command[*]}" \
      --out "$BENCH_OUT/${GPU_TESTS_JSON:-h200_gpu_tests.json}" >> "$BENCH_OUT/gpu-tests.log" 2>&1
  return $status
}

run_restart_test() {
  python3 -m pytest tests/engine/test_restarts.py -v -s -rs -p no:cacheprovider > "$BENCH_OUT/restart-test.log" 2>&1
}

run_bench() {
  local skip_layer=() variants=()
  wants layer && skip_layer=(--skip-layer)  # timed alone
  for v in ${BENCH_VARIANTS:-defer-1:KT_MAX_DEFERRED_EXPERTS_PER_TOKEN=1 defer-2:KT_MAX_DEFERRED_EXPERTS_PER_TOKEN=2 \
             metrics:KT_METRICS_INTERVAL=2}; do variants+=(--variant "$v"); done
  local off_check=(--prefill-off-check)
  [ "${PREFILL_OFF_CHECK:-1}" = 0 ] && off_check=()  # e.g. off everywhere (--kt-env) and a variant turns it on
  # shellcheck disable=SC2086 - BENCH_RUN_ARGS is a list of arguments (this stage's only)
  "${BENCH[@]}" --systems "${BENCH_SYSTEMS:-vllm-gpu,vllm-offload,kt-hybrid}" --methods "${METHODS:-AMXINT4,AMXINT8}" \
      "${off_check[@]}" "${variants[@]}" "${skip_layer[@]}" "${SWEEP[@]}" ${BENCH_RUN_ARGS:-} \
      --out "$BENCH_OUT/${BENCH_JSON:-h200_qwen3_30b_a3b.json}" > "$BENCH_OUT/bench.log" 2>&1
}

run_peers() {
  "${BENCH[@]}" --systems "${PEER_SYSTEMS:-vllm-offload-experts,vllm-prefetch}" --skip-layer --append \
      --prefetch-sweep "${PREFETCH_SWEEP:-8:1,16:1,48:1,48:2}" \
      --out "$BENCH_OUT/${BENCH_JSON:-h200_qwen3_30b_a3b.json}" > "$BENCH_OUT/peers.log" 2>&1
}

run_load() {  # every system the same load (OFFLOAD_LOAD=N:C gives vLLM's offloaders a shorter one, recorded)
  # shellcheck disable=SC2086 - OFFLOAD_LOAD adds its flag where set
  local systems
  systems=$(without_sglang "${LOAD_SYSTEMS:-vllm-gpu,vllm-offload,kt-hybrid}")
  "${BENCH[@]}" --methods AMXINT4 --systems "$systems" \
      --prefetch-sweep "${PREFETCH_POINT:-48:1}" "${SGLANG[@]}" "${SWEEP[@]}" \
      --load 1000:64 ${OFFLOAD_LOAD:+--offload-load $OFFLOAD_LOAD} \
      --load-input-len 128 --load-output-len 16 \
      --out "$BENCH_OUT/${LOAD_JSON:-h200_load_qwen3_30b_a3b.json}" > "$BENCH_OUT/load-bench.log" 2>&1
}

run_server_engine() {  # kt-hybrid and sglang-kt through their servers: the head to head's decode and prefills
  local systems
  systems=$(without_sglang "${SERVER_ENGINE_SYSTEMS:-kt-hybrid,sglang-kt}")
  if [[ ",$systems," == *",sglang-kt,"* ]] && [ ! -f "$BENCH_OUT/sglang-check.log" ]; then  # no check: wait for it
    for _ in $(seq "${SGLANG_WAIT_S:-600}"); do [ -x "$SGLANG_PYTHON" ] && break; sleep 1; done
  fi
  # SERVER_LOAD=N:C: then the load against each server measured; SERVER_ENGINE_ARGS: e.g. --append
  # shellcheck disable=SC2086 - SERVER_ENGINE_ARGS is a list of arguments
  "${BENCH[@]}" --methods "${METHODS:-AMXINT4}" --systems "$systems" --server-engine \
      "${SGLANG[@]}" "${SWEEP[@]}" ${SERVER_LOAD:+--load $SERVER_LOAD} ${SERVER_ENGINE_ARGS:-} \
      --out "$BENCH_OUT/${SERVER_ENGINE_JSON:-h200_server_engine_qwen3_30b_a3b.json}" >> "$BENCH_OUT/server-engine.log" 2>&1
}

run_sweep() {  # bare kt-kernel through every layer, alone (no engine)
  "${BENCH[@]}" --systems kt-hybrid --methods "${METHODS:-AMXINT4}" --kernel-sweep --sweep-only --append \
      --out "$BENCH_OUT/${BENCH_JSON:-h200_qwen3_30b_a3b.json}" > "$BENCH_OUT/sweep.log" 2>&1
}

run_fp8_bench() {  # the block-FP8 checkpoint: FP8 on the GPU everywhere, kt-kernel FP8 on the CPU
  # shellcheck disable=SC2086 - FP8_BENCH_ARGS is a list of arguments
  VLLM_DEEP_GEMM_WARMUP=${FP8_DEEP_GEMM_WARMUP:-skip} "${FP8[@]}" --systems "${FP8_SYSTEMS:-kt-hybrid,vllm-gpu,vllm-offload}" \
      ${FP8_BENCH_ARGS:-} > "$BENCH_OUT/fp8-bench.log" 2>&1
}

run_prefill_test() {
  python3 -m pytest -m gpu tests/engine/test_gpu.py -k "gpu_prefill_matches and BF16" -v -s -rs -p no:cacheprovider \
      > "$BENCH_OUT/prefill-test.log" 2>&1
}

# The plugin into /root/gpusite once per tree (a sitting runs this script several times, two at once
# beside each other: a second pip into the same --target would race the first)
installed=$BENCH_OUT/.plugin-installed-$(cat pyproject.toml vllm_kt_plugin/__init__.py | sha256sum | cut -c1-12)
if ( set -o noclobber; : > "$installed.lock" ) 2> /dev/null; then
  stage "install"
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /root/gpusite . \
      > "$BENCH_OUT/install.log" 2>&1 || python3 -m pip install -q --no-deps -e . >> "$BENCH_OUT/install.log" 2>&1
  touch "$installed"
  nvidia-smi --query-gpu=name,memory.total --format=csv > "$BENCH_OUT/host.txt" 2>&1
  lscpu >> "$BENCH_OUT/host.txt" 2>&1
else
  for _ in $(seq 120); do [ -f "$installed" ] && break; sleep 1; done  # the other invocation's install
fi

for entry in $STAGES; do
  name=${entry%&}
  if [ "$name" = wait ]; then
    stage "waiting for the background stages"; wait; continue
  fi
  fn=run_${name//-/_}
  if ! declare -F "$fn" > /dev/null; then
    stage "unknown stage $name"; continue
  fi
  if [ "$entry" != "$name" ]; then
    ( stage "$name (background)"; "$fn"; stage "$name exit $?" ) &
  else
    gpu=$(python3 -m vllm_kt_tools.support.gpu_memory --wait "${GPU_FREE_WAIT_S:-30}" 2>&1 | tail -1)
    [ "$gpu" = free ] || stage "GPU not free before $name: $gpu"
    stage "$name"; "$fn"; stage "$name exit $?"
  fi
done
wait
tar czf "$BENCH_OUT/bench-logs.tgz" -C /root/bench-work logs 2>/dev/null
touch "$BENCH_OUT/DONE"
