"""The GGUF files kt-kernel's LLAMAFILE method reads, found and checked before it reads them.

kt-kernel 0.7.2's ``GGUFLoader`` trusts what it finds (a missing layer, a wrong shape, a
type its kernels do not compute, two quantizations in one folder: docs/design.md,
"Reliability"), so at config time the headers alone are read and every expert tensor is
checked against the Hugging Face config, with one error naming the file, the tensor and
what was expected. ``KT_WEIGHT_PATH`` may name a ``.gguf`` file, llama.cpp's first split
file (the whole set is read) or a folder holding one model's GGUF."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_kt_plugin.settings.errors import KTConfigError

# llama.cpp's split file names (llama-gguf-split, gguf-py's SHARD_NAME_FORMAT).
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
PROJECTIONS = ("gate", "up", "down")
# kt-kernel's LLAMAFILE computes in whole K-quant super-blocks (QK_K): the expert width and
# the hidden size must be multiples (the hidden size silently: Q8_0 experts of hidden 128 or
# 192 gave zeros, 384 and 640 a relative error of 0.45-0.59, 256 and 512 0.011; measured on
# the AMX box, 2026-12-06).
LLAMAFILE_BLOCK = 256

# GGML types kt-kernel 0.7.2's LLAMAFILE computes correctly, per CPU variant: measured on the
# 2-core AMX box, 2026-12-06, one layer (8 experts, hidden and width 256) of random weights
# written in each type, against float32 experts dequantized by gguf-py (relative error at
# 1 and 16 tokens; command: `pytest tests/unit/test_llamafile_types.py`, which repeats the
# measurement in every variant). F32/F16 0.002, Q8_0 0.011, Q4_0/Q5_0 0.012, Q4_K/Q5_K/Q6_K
# 0.018-0.022 in every variant; BF16 0.002 with amx and avx512_bf16, NaN with
# avx512_base/vnni/vbmi, an abort with avx2; Q4_1 and Q5_1 abort in every variant. Types not
# listed (Q2_K, Q3_K, the IQ types, ...) were not verified: gguf-py 0.19 cannot write them.
LLAMAFILE_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K")
LLAMAFILE_BF16_VARIANTS = frozenset({"amx", "avx512_bf16"})


def llamafile_types(variant: str) -> tuple[str, ...]:
    """The GGML expert types the ``variant`` build's LLAMAFILE computes correctly."""
    return LLAMAFILE_TYPES + (("BF16",) if variant in LLAMAFILE_BF16_VARIANTS else ())


@dataclass(frozen=True)
class GGUFTensor:
    file: str  # the file's name
    type_name: str  # GGML type, e.g. Q4_K
    shape: tuple[int, ...]  # as PyTorch orders it: [experts, rows, row length]


def _bad(weight_path: str, reason: str, allowed: str | None = None) -> KTConfigError:
    return KTConfigError(
        "KT_WEIGHT_PATH",
        weight_path,
        reason,
        allowed
        or "a .gguf file, the first file of a llama.cpp split set (*-00001-of-0000N.gguf), or a folder holding one "
        "model's GGUF file(s), with llama.cpp's tensor names",
    )


def is_gguf_path(path: str) -> bool:
    """Whether ``path`` names GGUF weights: a .gguf file, or a folder with .gguf files in it."""
    p = Path(path)
    if p.is_file():
        return p.suffix == ".gguf"
    return p.is_dir() and any(f.suffix == ".gguf" and f.is_file() for f in p.iterdir())


def split_set(path: Path) -> list[Path] | None:
    """All files of the llama.cpp split set ``path`` belongs to, or None if it is none."""
    match = SPLIT_NAME.match(path.name)
    if match is None:
        return None
    count = int(match["count"])
    return [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def gguf_files(weight_path: str) -> list[Path]:
    """The GGUF files of the model ``weight_path`` names (file, split set or folder)."""
    path = Path(weight_path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise _bad(weight_path, "not a .gguf file")
        parts = split_set(path)
        if parts is None:
            return [path]
        missing = [p.name for p in parts if not p.is_file()]
        if missing:
            raise _bad(weight_path, f"{missing[0]} is missing: the split set has {len(parts)} files")
        return parts
    files = sorted(f for f in path.iterdir() if f.suffix == ".gguf" and f.is_file())
    if not files:
        nested = sorted({str(f.parent.relative_to(path)) for f in path.rglob("*.gguf")})
        where = f"; its subfolders {', '.join(nested[:4])} do: point KT_WEIGHT_PATH at one of them" if nested else ""
        raise _bad(weight_path, f"holds no .gguf file (kt-kernel reads those directly in the folder){where}")
    return files


def read_gguf_index(weight_path: str, files: Sequence[Path]) -> tuple[dict[str, GGUFTensor], dict[str, object]]:
    """Tensor name -> file, type and shape, and the metadata, from the files' headers (the
    tensor data stays unread: gguf-py maps the file). A name in two files is refused: kt-kernel
    would read one of them, e.g. one of two quantizations kept side by side."""
    from gguf import GGUFReader, GGUFValueType

    index: dict[str, GGUFTensor] = {}
    metadata: dict[str, object] = {}
    for path in files:
        try:
            reader = GGUFReader(path)
        except Exception as exc:  # gguf-py raises ValueError/IndexError/... for a broken header
            reason = (
                f"{path.name} cannot be read as GGUF ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
            )
            raise _bad(weight_path, f"{reason}: truncated or damaged?") from None
        for key, field in reader.fields.items():
            # scalars only: a real file's tokenizer arrays (150k strings) would take seconds
            if key.startswith("GGUF.") or not field.data or field.types[0] == GGUFValueType.ARRAY:
                continue
            metadata.setdefault(key, field.contents())
        for tensor in reader.tensors:
            if tensor.name in index:
                raise _bad(
                    weight_path,
                    f"{tensor.name} is in both {index[tensor.name].file} and {path.name}: the folder holds more than "
                    "one model's GGUF (kt-kernel would mix them)",
                    "the path of one .gguf file (or of the first file of a split set), or a folder holding only it",
                )
            shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
            index[tensor.name] = GGUFTensor(path.name, tensor.tensor_type.name, shape)
    return index, metadata


def _where(files: Sequence[Path]) -> str:
    return files[0].name if len(files) == 1 else f"{files[0].name} .. {files[-1].name}"


def check_gguf(
    weight_path: str,
    layers: Sequence[int],
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    variant: str,
) -> list[Path]:
    """Every routed expert of every MoE layer in the GGUF, of the model's shapes and in a type
    the ``variant`` build's LLAMAFILE computes; returns the files."""
    files = gguf_files(weight_path)
    index, metadata = read_gguf_index(weight_path, files)
    types = llamafile_types(variant)
    e, h, i = num_experts, hidden_size, intermediate_size
    expected_shapes = {"gate": (e, i, h), "up": (e, i, h), "down": (e, h, i)}
    for layer in layers:
        for projection in PROJECTIONS:
            name = f"blk.{layer}.ffn_{projection}_exps.weight"
            tensor = index.get(name)
            if tensor is None:
                found = sorted({int(n.split(".")[1]) for n in index if n.endswith("_exps.weight")})
                held = f"expert layers {found[0]}..{found[-1]}" if found else "no routed-expert tensors"
                raise _bad(
                    weight_path,
                    f"{_where(files)}: no {name} (the checkpoint's MoE layers are {layers[0]}..{layers[-1]}; the "
                    f"file holds {held})",
                )
            want = expected_shapes[projection]
            if tensor.shape != want:
                what = (
                    f"{want[0]} experts"
                    if len(tensor.shape) == 3 and tensor.shape[0] != want[0]
                    else f"the checkpoint's hidden_size {h} and moe_intermediate_size {i}"
                )
                raise _bad(
                    weight_path,
                    f"{tensor.file}: {name} is {tensor.type_name} {list(tensor.shape)}, expected {list(want)} ({what})",
                )
            if tensor.type_name not in types:
                raise _bad(
                    weight_path,
                    f"{tensor.file}: {name} is {tensor.type_name}, which kt-kernel's LLAMAFILE ({variant} build) does "
                    f"not compute correctly; expected one of {', '.join(types)}",
                    f"GGUF experts in {', '.join(types)} (e.g. llama.cpp's Q4_K_M, Q5_K_M, Q6_K, Q8_0 files)",
                )
    # the declared count too: the file of a model with more experts whose first ones match
    arch = metadata.get("general.architecture")
    declared = metadata.get(f"{arch}.expert_count")
    if isinstance(declared, int) and declared != num_experts:
        raise _bad(weight_path, f"{files[0].name} declares {arch}.expert_count={declared}, expected {num_experts}")
    return files


def kt_kernel_path(weight_path: str, files: Sequence[Path], links_root: str) -> str:
    """The path to hand kt-kernel for ``files``: the file itself, or a folder holding exactly
    them (kt-kernel reads one file, or every .gguf of a folder): the user's folder where it
    holds nothing else, else a folder of links under ``links_root``."""
    path = Path(weight_path)
    if len(files) == 1:
        return str(files[0])
    folder = files[0].parent
    if path.is_dir() or sorted(f for f in folder.iterdir() if f.suffix == ".gguf") == sorted(files):
        return str(folder)
    digest = hashlib.sha256("\n".join(str(f.resolve()) for f in files).encode()).hexdigest()[:16]
    links = Path(links_root) / "gguf-splits" / digest
    links.mkdir(parents=True, exist_ok=True)
    for f in files:
        link = links / f.name
        if not link.is_symlink():
            os.symlink(f.resolve(), link)
    return str(links)
