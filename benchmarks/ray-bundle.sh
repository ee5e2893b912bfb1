#!/usr/bin/env bash
# Ray for the offline GPU host (tests/engine/test_ray_gpu.py), next to the vLLM bundle:
#   bash benchmarks/ray-bundle.sh pack       # here: wheels -> .gpubundle/ray/raypart* (< 64 MiB each)
#   bash .gpubundle/ray/ray-bundle.sh install # there, once per carried part; installs when all arrived
# Ray goes to /root/raysite, a target of its own: pip --target does not add its `ray`
# script to /root/gpusite/bin, which exists already. benchmarks/run_h200.sh picks it up.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
case "${1:-}" in
pack)
    OUT=.gpubundle/ray WORK=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
        --platform manylinux2014_x86_64 -d "$WORK" ray==2.60.0 msgpack==1.2.4
    rm -rf "$OUT" && mkdir -p "$OUT"
    tar cf "$WORK/ray.tar" -C "$WORK" $(cd "$WORK" && ls *.whl)
    split -b 45M -d "$WORK/ray.tar" "$OUT/raypart"
    sha256sum "$WORK/ray.tar" | cut -d' ' -f1 > "$OUT/SHA256"
    ls "$OUT"/raypart* | wc -l > "$OUT/PARTS"
    cp "$0" "$OUT/ray-bundle.sh"
    rm -rf "$WORK"
    echo "carry $(ls "$OUT" | tr '\n' ' ')from $OUT, one raypart per call"
    ;;
install)
    STORE=/root/raybundle
    mkdir -p "$STORE"
    for p in "$HERE"/raypart*; do [ -e "$p" ] && mv "$p" "$STORE/"; done
    if [ -x /root/raysite/bin/ray ]; then echo "ray installed already"; exit 0; fi
    have=$(ls "$STORE"/raypart* 2>/dev/null | wc -l)
    if [ "$have" -lt "$(cat "$HERE/PARTS")" ]; then echo "have $have of $(cat "$HERE/PARTS") ray parts"; exit 0; fi
    cat "$STORE"/raypart* > "$STORE/ray.tar"
    echo "$(cat "$HERE/SHA256")  $STORE/ray.tar" | sha256sum -c -
    mkdir -p "$STORE/x" && tar xf "$STORE/ray.tar" -C "$STORE/x"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /root/raysite "$STORE"/x/*.whl
    rm -rf "$STORE/x" "$STORE/ray.tar"
    PYTHONPATH=/root/raysite:/root/gpusite python3 -c "import ray; print('ray', ray.__version__)"
    ;;
*) echo "usage: $0 pack|install" >&2; exit 2 ;;
esac
