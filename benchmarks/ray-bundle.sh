#!/usr/bin/env bash
# Ray for the offline GPU host (tests/engine/test_ray_gpu.py), next to the vLLM bundle:
#   bash benchmarks/ray-bundle.sh pack       # here: wheels -> .gpubundle/ray/raypart* (benchmarks/parts.sh)
#   bash .gpubundle/ray/ray-bundle.sh install # there, once per carried part; installs when all arrived
# Ray goes to /root/raysite, a target of its own: pip --target does not add its `ray`
# script to /root/gpusite/bin, which exists already. benchmarks/run_h200.sh picks it up.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/parts.sh"
case "${1:-}" in
pack)
    OUT=.gpubundle/ray WORK=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
        --platform manylinux2014_x86_64 -d "$WORK" ray==2.60.0 msgpack==1.2.4
    rm -rf "$OUT" && mkdir -p "$OUT"
    tar cf "$WORK/ray.tar" -C "$WORK" $(cd "$WORK" && ls *.whl)
    pack_parts "$WORK/ray.tar" "$OUT" raypart "$0"
    rm -rf "$WORK"
    ;;
install)
    STORE=/root/raybundle
    if [ -x /root/raysite/bin/ray ]; then echo "ray installed already"; exit 0; fi
    gather_parts "$HERE" "$STORE" raypart "$STORE/ray.tar" || exit 0
    mkdir -p "$STORE/x" && tar xf "$STORE/ray.tar" -C "$STORE/x"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /root/raysite "$STORE"/x/*.whl
    rm -rf "$STORE/x" "$STORE/ray.tar"
    PYTHONPATH=/root/raysite:/root/gpusite python3 -c "import ray; print('ray', ray.__version__)"
    ;;
*) echo "usage: $0 pack|install" >&2; exit 2 ;;
esac
