#!/usr/bin/env bash
# What vLLM's CUDA build imports for sparse MLA (GLM-5's and DeepSeek-V3.2's DSA) and for
# DeepSeek-V4, beside the vLLM bundle (../shared/gpu-host/), for the offline GPU host:
#   bash benchmarks/sparse-attention-bundle.sh pack          # here: wheels -> .gpubundle/dsa/dsapart* (benchmarks/parts.sh)
#   bash .gpubundle/dsa/sparse-attention-bundle.sh install   # there, once per carried part
# Why each (vLLM 0.32.0's sources): every sparse-MLA forward imports CuTe-DSL (`fused_q`, even
# on SM90 where the kernel is Triton): nvidia-cutlass-dsl (its cu13 flavour only: it loads the
# newest the driver takes) and cuda-bindings; DeepSeek-V4's mHC kernels need tilelang (with z3,
# and apache-tvm-ffi 0.1.11, which vLLM pins and the vLLM bundle has newer) and its compressor
# quack-kernels. DeepGEMM, FlashMLA and FA3 come in vLLM's wheel; nvcc in the host's image.
# They go to /root/dsasite, ahead of /root/gpusite on the path (tvm-ffi shadows the newer one);
# benchmarks/sittings/model-check-cuda.sh picks it up.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/parts.sh"
SITE=/root/dsasite
case "${1:-}" in
pack)
    OUT=.gpubundle/dsa WORK=$(mktemp -d)
    PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp)
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
             manylinux2014_x86_64; do PLAT+=(--platform "$p"); done
    python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK" \
        nvidia-cutlass-dsl==4.8.0 nvidia-cutlass-dsl-libs-base==4.8.0 nvidia-cutlass-dsl-libs-core==4.8.0 \
        nvidia-cutlass-dsl-libs-cu13==4.8.0 cuda-bindings==13.0.3 cuda-pathfinder==1.9.1 \
        tilelang==0.1.12 z3-solver==4.15.4.0 apache-tvm-ffi==0.1.11 quack-kernels==0.6.5 \
        ml-dtypes==0.7.0 torch-c-dlpack-ext==0.1.5
    rm -rf "$OUT" && mkdir -p "$OUT"
    tar cf "$WORK/dsa.tar" -C "$WORK" $(cd "$WORK" && ls *.whl)
    pack_parts "$WORK/dsa.tar" "$OUT" dsapart "$0"
    rm -rf "$WORK"
    ;;
install)
    STORE=/root/dsabundle
    if [ -f "$SITE/env.sh" ]; then echo "installed already: source $SITE/env.sh"; exit 0; fi
    gather_parts "$HERE" "$STORE" dsapart "$STORE/dsa.tar" || exit 0
    mkdir -p "$STORE/x" && tar xf "$STORE/dsa.tar" -C "$STORE/x"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$STORE"/x/*.whl
    rm -rf "$STORE/x" "$STORE/dsa.tar"
    # cutlass is put on the path by a .pth file, which Python reads only in site directories
    cat > "$SITE/env.sh" <<ENV
export PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages\${PYTHONPATH:+:\$PYTHONPATH}
ENV
    . /root/gpusite/env.sh && . "$SITE/env.sh"
    python3 -c "import cutlass, tilelang, quack, tvm_ffi; print('cutlass-dsl, tilelang', tilelang.__version__, 'tvm-ffi', tvm_ffi.__version__)"
    which nvcc || ls /usr/local/cuda/bin/nvcc
    ;;
*) echo "usage: $0 pack|install" >&2; exit 2 ;;
esac
