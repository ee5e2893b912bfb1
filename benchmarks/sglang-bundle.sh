#!/usr/bin/env bash
# Build sglang-kt 0.7.2's package set (KTransformers' SGLang fork, the `sglang-kt` peer of
# `vllm-kt bench`, issue 27) for an offline CUDA / Python 3.12 GPU host, in parts small enough
# to carry one at a time, like ../shared/gpu-host/build-bundle.sh does for vLLM. It lives apart
# from vLLM's set: sglang-kt pins torch 2.9.1 (CUDA 12.8 wheels and their nvidia-*-cu12 libs),
# vLLM 0.32 torch 2.13. Run from the root of a git checkout; output goes to .sglbundle/
# (added to .git/info/exclude). Wheels are cached in $SGLBUNDLE_CACHE (one exists on the dev
# box: ~/.cache/sglbundle/full, 4.8 GB, 177 wheels).
#
# On the GPU host, for every part in turn (same machine, back to back):
#     bash .sglbundle/install-part.sh       # with .sglbundle/{install-part.sh,MANIFEST,partNN}
# The call that brings the last part installs everything into /root/sglsite and writes
# /root/sglsite/python, the interpreter to give the bench:  export SGLANG_PYTHON=/root/sglsite/python
#
# NOT RUN ON A GPU YET: whether sglang-kt starts with TRIM's packages left out is unchecked
# (TRIM="" carries everything, ~85 parts). DRY_RUN=1 only lists what would go in and its size.
set -euo pipefail
PART_MIB=${PART_MIB:-56}
CACHE=${SGLBUNDLE_CACHE:-$HOME/.cache/sglbundle/full}
OUT=.sglbundle
# Left out by default: audio/video/multimodal decoders, notebook and profiling tools, the
# dataset stack of SGLang's own bench, ModelScope. Kept: torch 2.9.1 and every nvidia-*-cu12
# lib it preloads at import (cuDNN, cuBLAS, NCCL, cuSPARSELt...), triton 3.5.1, flashinfer
# (python and its cubins: the host has no nvcc for flashinfer's JIT), kt-kernel whole (its
# wheel carries the sgl-native kernels sglang-kt calls, which vLLM's bundle strips).
TRIM=${TRIM-"torchaudio torchcodec decord2 av soundfile timm py_spy ipython ipython_pygments_lexers jedi parso pexpect
ptyprocess prompt_toolkit stack_data executing asttokens pure_eval matplotlib_inline traitlets modelscope modelscope_hub
datasets pyarrow multiprocess"}
# torch 2.9.1 and its nvidia-*-cu12 libs are 3.7 of the 4.8 GB. Where the host image already
# has nvidia-*-cu12 libs of these versions (check there: python3 -m pip list | grep cu12),
# HOST_NVIDIA=1 leaves them out too (unchecked: torch finds them on sys.path at import).
if [ -n "${HOST_NVIDIA:-}" ]; then
  TRIM="$TRIM $(ls "$CACHE" 2> /dev/null | grep -o '^nvidia_[a-z_]*_cu12' | sort -u | tr '\n' ' ')"
fi

[ -d "$CACHE" ] && ls "$CACHE"/sglang_kt-0.7.2-*.whl > /dev/null 2>&1 || {
  echo "no sglang-kt 0.7.2 wheels in $CACHE: fill it first (pip download --only-binary=:all: --python-version 3.12" \
       "--platform manylinux_2_35_x86_64 ... -d $CACHE sglang-kt==0.7.2)" >&2
  exit 1
}

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/wheels"
kept=0 trimmed=0
for w in "$CACHE"/*.whl; do
  dist=$(basename "$w" | cut -d- -f1 | tr 'A-Z-' 'a-z_')
  if [[ " $(echo $TRIM | tr 'A-Z-' 'a-z_') " == *" $dist "* ]]; then
    trimmed=$((trimmed + $(stat -c %s "$w")))
  else
    kept=$((kept + $(stat -c %s "$w")))
    [ -n "${DRY_RUN:-}" ] || ln "$w" "$STAGE/wheels/" 2> /dev/null || cp "$w" "$STAGE/wheels/"
  fi
done
parts=$(( (kept + PART_MIB * 1048576 - 1) / (PART_MIB * 1048576) ))
echo "sglang-kt bundle: $((kept / 1048576)) MiB kept (~$parts parts of $PART_MIB MiB), $((trimmed / 1048576)) MiB trimmed"
[ -n "${DRY_RUN:-}" ] && exit 0

mkdir -p "$OUT"
grep -qx '/.sglbundle/' .git/info/exclude 2> /dev/null || echo '/.sglbundle/' >> .git/info/exclude
tar cf "$STAGE/bundle.tar" -C "$STAGE" wheels
rm -f "$OUT"/part*
split -b "${PART_MIB}M" -d -a 3 "$STAGE/bundle.tar" "$OUT/part"
n=$(ls "$OUT"/part* | wc -l)
{ echo "parts=$n"; echo "sha256=$(sha256sum "$STAGE/bundle.tar" | cut -d' ' -f1)"; } > "$OUT/MANIFEST"
cat > "$OUT/install-part.sh" << 'INSTALL'
#!/usr/bin/env bash
# GPU-host side of benchmarks/sglang-bundle.sh: keep the parts that arrived; once all are
# there, verify, unpack and install into /root/sglsite, apart from vLLM's /root/gpusite.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
STORE=/root/sglbundle SITE=/root/sglsite
mkdir -p "$STORE"
cp "$HERE/MANIFEST" "$STORE/MANIFEST"
for p in "$HERE"/part*; do [ -e "$p" ] && mv "$p" "$STORE/"; done
. "$STORE/MANIFEST"
if [ -x "$SITE/python" ]; then echo "installed already: export SGLANG_PYTHON=$SITE/python"; exit 0; fi
have=$(ls "$STORE"/part* 2> /dev/null | wc -l)
if [ "$have" -lt "$parts" ]; then echo "have $have of $parts parts"; exit 0; fi
cat "$STORE"/part* > "$STORE/bundle.tar"
echo "$sha256  $STORE/bundle.tar" | sha256sum -c -
mkdir -p "$STORE/x" && tar xf "$STORE/bundle.tar" -C "$STORE/x"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$STORE"/x/wheels/*.whl
rm -rf "$STORE/x" "$STORE/bundle.tar" "$STORE"/part*
# its own interpreter: /root/sglsite first, no user site, none of vLLM's /root/gpusite
cat > "$SITE/python" << PY
#!/usr/bin/env bash
PYTHONPATH=$SITE PATH=$SITE/bin:\$PATH exec python3 -s "\$@"
PY
chmod +x "$SITE/python"
"$SITE/python" -c "import torch, sglang, kt_kernel; print('torch', torch.__version__, torch.cuda.is_available(), '| sglang', sglang.__version__, '| kt_kernel', kt_kernel.__version__, kt_kernel.__cpu_variant__)"
echo "installed: export SGLANG_PYTHON=$SITE/python"
INSTALL
echo "bundle: $n parts in $OUT/ ($(du -sh "$OUT" | cut -f1)); carry per call: .sglbundle/install-part.sh .sglbundle/MANIFEST .sglbundle/partNNN"
