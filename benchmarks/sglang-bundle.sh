#!/usr/bin/env bash
# Build sglang-kt 0.7.2's package set (KTransformers' SGLang fork, the `sglang-kt` peer of
# `vllm-kt bench`) for the offline CUDA / Python 3.12 GPU host, in parts small enough to carry
# one per call, like ../shared/gpu-host/build-bundle.sh does for vLLM. It lives apart from
# vLLM's set: sglang-kt pins torch 2.9.1 (CUDA 12.8 wheels and their nvidia-*-cu12 libs), vLLM
# 0.32 torch 2.13. Run from the root of a git checkout; output goes to .sglbundle/ (added to
# .git/info/exclude).
#
# The set is `ktransformers[sglang]==0.7.2`, not `sglang-kt` alone: only the ktransformers
# wheel carries sgl_kernel/sm90/common_ops.abi3.so (what sgl_kernel loads on an H100) and the
# fifth payload module. Its wheels are cached in $SGLBUNDLE_CACHE (~/.cache/sglbundle/full):
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_35_x86_64 \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d ~/.cache/sglbundle/full \
#       'ktransformers[sglang]==0.7.2'
# vllm_kt_tools/bench/sglang_bundle.py leaves out the wheels it names (TRIMMED, each with its
# reason) and checks the rest before anything is split: the sm90 ops, the five payload modules
# and their checksum, one version per distribution, and a static walk of what sglang-kt's server
# imports. A failing check builds nothing. DRY_RUN=1 stops after the check.
#
# On the GPU host, each call bringing .sglbundle/{install-part.sh,MANIFEST} and one part:
#     bash .sglbundle/install-part.sh                  # stores its part: "have k of N parts"
# and once, at a quiet moment of the sitting (installing is ~10 GB of files: never beside a timed run):
#     bash .sglbundle/install-part.sh --install [WAIT_S]  # waits up to WAIT_S (0) for missing parts,
#                                                   # verifies, unpacks, installs into /root/sglsite
# then check it there: `/root/sglsite/python -m vllm_kt_tools.bench.sglang_check` (run_h200.sh's stages
# sglang-install and sglang-check do both; docs/benchmarks.md, *sglang-kt*).
set -euo pipefail
PART_MIB=${PART_MIB:-56}
CACHE=${SGLBUNDLE_CACHE:-$HOME/.cache/sglbundle/full}
OUT=.sglbundle
# the sources are Python 3.12's: parse them with 3.12 where there is one (3.11 cannot read a few)
if [ -z "${PYTHON:-}" ]; then
  for PYTHON in python3.12 python3; do "$PYTHON" -c '' 2> /dev/null && break; done
fi
CHECK=("$PYTHON" -m vllm_kt_tools.bench.sglang_bundle)

ls "$CACHE"/ktransformers-0.7.2-*.whl > /dev/null 2>&1 || {
  echo "no ktransformers 0.7.2 wheel in $CACHE: fill it first (pip download --only-binary=:all: --python-version 3.12" \
       "--platform manylinux_2_35_x86_64 ... -d $CACHE 'ktransformers[sglang]==0.7.2')" >&2
  exit 1
}

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
"${CHECK[@]}" plan "$CACHE" --link-into "$STAGE/wheels"
"${CHECK[@]}" check "$STAGE/wheels" --reference "$CACHE" --json "$STAGE/check.json" || {
  echo "sglang-kt's package set fails its check (above): no bundle built" >&2
  exit 1
}
[ -n "${DRY_RUN:-}" ] && exit 0

mkdir -p "$OUT"
exclude=$(git rev-parse --git-path info/exclude)  # a worktree's is its repository's
grep -qx '/.sglbundle/' "$exclude" 2> /dev/null || echo '/.sglbundle/' >> "$exclude"
rm -f "$OUT"/part* "$OUT"/MANIFEST
tar cf - -C "$STAGE" wheels | split -b "${PART_MIB}M" -d -a 3 - "$OUT/part"
n=$(ls "$OUT"/part* | wc -l)
{
  echo "parts=$n"
  echo "sha256=$(cat "$OUT"/part* | sha256sum | cut -d' ' -f1)"
  echo "wheels=$(ls "$STAGE"/wheels | wc -l)"
} > "$OUT/MANIFEST"
cp "$STAGE/check.json" "$OUT/check.json"  # the check's verdict, for the record (not carried)
cat > "$OUT/install-part.sh" << 'INSTALL'
#!/usr/bin/env bash
# GPU-host side of benchmarks/sglang-bundle.sh. Without arguments: keep the parts this call
# brought (in $SGLBUNDLE_STORE, outside the checkout) and say how many are there; it never
# installs, so a part may arrive beside a timed run. With --install [WAIT_S]: wait up to
# WAIT_S seconds for all parts, verify their sha256, unpack and install into $SGLSITE with
# its own interpreter, $SGLSITE/python (torch 2.9.1 apart from vLLM's /root/gpusite).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
STORE=${SGLBUNDLE_STORE:-/root/sglbundle} SITE=${SGLSITE:-/root/sglsite} PY=${SGLBUNDLE_PYTHON:-python3}
mkdir -p "$STORE"
if [ "$HERE" != "$(cd "$STORE" && pwd)" ]; then  # a copy by the parts, for run_h200.sh's sglang-install stage
  cp "$0" "$STORE/install-part.sh"
  [ -f "$HERE/MANIFEST" ] && cp "$HERE/MANIFEST" "$STORE/MANIFEST"
  for p in "$HERE"/part[0-9]*; do [ -e "$p" ] && mv "$p" "$STORE/"; done  # run from the store: they are there
fi
[ -f "$STORE/MANIFEST" ] || { echo "no MANIFEST: carry .sglbundle/MANIFEST with the parts" >&2; exit 1; }
. "$STORE/MANIFEST"
have() { ls "$STORE"/part[0-9]* 2> /dev/null | wc -l; }
if [ -x "$SITE/python" ]; then echo "installed already: export SGLANG_PYTHON=$SITE/python"; exit 0; fi
if [ "${1:-}" != --install ]; then echo "have $(have) of $parts parts"; exit 0; fi
deadline=$((SECONDS + ${2:-0}))
while [ "$(have)" -lt "$parts" ]; do
  [ "$SECONDS" -ge "$deadline" ] && { echo "have $(have) of $parts parts: not installing" >&2; exit 1; }
  sleep 2
done
started=$SECONDS
sum=$(cat "$STORE"/part[0-9]* | sha256sum | cut -d' ' -f1)
[ "$sum" = "$sha256" ] || { echo "the $parts parts do not give the MANIFEST's sha256: not installing" >&2; exit 1; }
rm -rf "$STORE/x" && mkdir -p "$STORE/x"
cat "$STORE"/part[0-9]* | tar xf - -C "$STORE/x"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$STORE"/x/wheels/*.whl
rm -rf "$STORE/x" "$STORE"/part[0-9]*
# its own interpreter: $SITE first, no user site, none of vLLM's /root/gpusite
cat > "$SITE/python" << PY
#!/usr/bin/env bash
PYTHONPATH=$SITE PATH=$SITE/bin:\$PATH exec $PY -s "\$@"
PY
chmod +x "$SITE/python"
echo "installed in $((SECONDS - started)) s: export SGLANG_PYTHON=$SITE/python"
INSTALL
echo "bundle: $n parts of $PART_MIB MiB in $OUT/ ($(du -sh "$OUT" | cut -f1)); carry per call:" \
     ".sglbundle/install-part.sh .sglbundle/MANIFEST .sglbundle/partNNN"
