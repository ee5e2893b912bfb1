#!/usr/bin/env bash
# What a detached sitting has written so far, into $OUT, which the device tool brings back with
# the call: every JSON of $BENCH_OUT (at most 6, newest first), stages.log, and logs.tgz (the
# last 400 kB of every log: the sitting's, its stages', each engine's and server's). Call it at
# the end of every call of a sitting: a host taken back early keeps what its last call copied.
set -u
B=${BENCH_OUT:-/root/bench-out}
if [ -z "${OUT:-}" ]; then echo "collect: OUT is unset (the device tool sets it)"; exit 0; fi
ls -t "$B"/*.json 2> /dev/null | head -6 | while read -r f; do cp "$f" "$OUT/"; done
[ -f "$B/stages.log" ] && cp "$B/stages.log" "$OUT/"
tmp=$(mktemp -d)
mkdir -p "$tmp/logs/out" "$tmp/logs/work"
for f in /root/sitting.log "$B"/*.log; do [ -f "$f" ] && tail -c 400000 "$f" > "$tmp/logs/out/$(basename "$f")"; done
for f in /root/bench-work/logs/*.log; do [ -f "$f" ] && tail -c 400000 "$f" > "$tmp/logs/work/$(basename "$f")"; done
tar czf "$OUT/logs.tgz" -C "$tmp" logs && rm -rf "$tmp"
echo "collect: $(ls "$OUT" | tr '\n' ' ')"
[ -f "$B/stages.log" ] && tail -4 "$B/stages.log"
nvidia-smi --query-gpu=memory.used --format=csv,noheader 2> /dev/null | sed 's/^/collect: GPU memory used /'
exit 0
