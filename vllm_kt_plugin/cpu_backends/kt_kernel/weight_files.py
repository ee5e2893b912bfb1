"""What kt-kernel will read from KT_WEIGHT_PATH (or the model directory), checked before
it reads it.

kt-kernel 0.7.2's safetensors loaders trust the files: a file that does not open is
skipped with a print (so its experts are "not found", naming the wrong cause), an expert
whose gate tensor is missing ends the expert count early (the C++ side then reads
pointers that were never set), and a tensor of the wrong shape is read as if it had the
right one (the server serves garbage without an error). So every file is opened here,
and every CPU-expert tensor the loader will look up is checked for presence, dtype and
shape, with one error naming the layer, the expert and the file.

Shapes and dtypes are checked for BF16 (the checkpoint's own tensors); for the other
methods that read a Hugging Face checkpoint the files are checked to open.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_kt_plugin.settings.errors import KTConfigError

# kt-kernel's BF16 loader names (kt_kernel.utils.loader.BF16SafeTensorLoader.MOE_FORMATS):
# experts under "<layer>.mlp.experts" (DeepSeek, Qwen) or "<layer>.block_sparse_moe.experts"
# (Mixtral), with these projection names for gate, up and down.
BF16_LAYOUTS = (
    (".mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    (".block_sparse_moe.experts", ("w1", "w3", "w2")),
)
# Decoder-layer prefixes kt-kernel's NativeMoEWrapper.load_weights tries, in its order.
LAYER_PREFIXES = ("model.layers.{}", "language_model.model.layers.{}", "model.language_model.layers.{}")


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str  # as safetensors names it: BF16, F16, F32, F8_E4M3, I32, ...
    shape: tuple[int, ...]


def _bad(weight_path: str, reason: str, is_model_dir: bool) -> KTConfigError:
    allowed = (
        "a directory whose *.safetensors hold every routed expert of every MoE layer, in the checkpoint's "
        "shapes (kt-kernel loads all experts of a layer, GPU ones included)"
    )
    where = f"the model directory {weight_path} (KT_WEIGHT_PATH unset)" if is_model_dir else weight_path
    return KTConfigError("KT_WEIGHT_PATH", where, reason, allowed)


def safetensors_files(directory: str) -> list[Path]:
    """The files kt-kernel's loaders walk: every *.safetensors below ``directory``."""
    return sorted(Path(root) / f for root, _, files in os.walk(directory) for f in files if f.endswith(".safetensors"))


def read_index(directory: str, *, is_model_dir: bool = False) -> dict[str, TensorInfo]:
    """Name -> file, dtype and shape of every tensor; a file that does not open (truncated,
    not safetensors) is an error naming it."""
    from safetensors import safe_open

    index: dict[str, TensorInfo] = {}
    for path in safetensors_files(directory):
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open handles are not dicts
                    meta = handle.get_slice(name)
                    index[name] = TensorInfo(path.name, str(meta.get_dtype()), tuple(meta.get_shape()))
        except Exception as exc:  # safetensors raises its own error types for broken files
            reason = f"{path.relative_to(directory)} cannot be read ({str(exc).splitlines()[0]}): truncated or damaged?"
            raise _bad(directory, reason, is_model_dir) from None
    return index


def _expert_names(layer: int, expert: int, index: dict[str, TensorInfo]) -> Iterator[tuple[str, str]]:
    """(projection, tensor name) of one expert, in the layout the checkpoint uses."""
    for prefix_template in LAYER_PREFIXES:
        prefix = prefix_template.format(layer)
        for experts, projections in BF16_LAYOUTS:
            base = f"{prefix}{experts}"
            if f"{base}.0.{projections[0]}.weight" in index:
                for projection in projections:
                    yield projection, f"{base}.{expert}.{projection}.weight"
                return
    yield from ((projection, "") for projection in BF16_LAYOUTS[0][1])


def _packed_experts(layer: int, index: dict[str, TensorInfo]) -> str | None:
    """The "<layer>.mlp.experts" prefix where the layer stores all experts in two stacked
    tensors (gate_up_proj, down_proj; Qwen3.5-MoE), which kt-kernel also reads."""
    for prefix_template in LAYER_PREFIXES:
        base = f"{prefix_template.format(layer)}.mlp.experts"
        if f"{base}.gate_up_proj" in index:
            return base
    return None


def _expect(
    directory: str,
    info: TensorInfo | None,
    where: str,
    label: str,
    shape: tuple[int, ...],
    missing: str,
    is_model_dir: bool,
) -> None:
    if info is None:
        raise _bad(directory, f"{where}: no {missing} in any *.safetensors file", is_model_dir)
    if info.shape != shape or info.dtype != "BF16":
        reason = f"{where}: {label} in {info.file} is {info.dtype} {list(info.shape)}, expected BF16 {list(shape)}"
        raise _bad(directory, reason, is_model_dir)


def check_bf16_experts(
    directory: str,
    layers: Sequence[int],
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    *,
    is_model_dir: bool = False,
) -> None:
    """Every routed expert of every MoE layer present as BF16 gate/up/down tensors of the
    model's shapes: gate and up [intermediate, hidden], down [hidden, intermediate]."""
    index = read_index(directory, is_model_dir=is_model_dir)
    h, i, e = hidden_size, intermediate_size, num_experts
    for layer in layers:
        packed = _packed_experts(layer, index)
        if packed is not None:
            for name, shape in ((f"{packed}.gate_up_proj", (e, 2 * i, h)), (f"{packed}.down_proj", (e, h, i))):
                _expect(directory, index.get(name), f"layer {layer}", name, shape, name, is_model_dir)
            continue
        shapes = ((i, h), (i, h), (h, i))
        for expert in range(num_experts):
            for shape, (projection, name) in zip(shapes, _expert_names(layer, expert, index), strict=True):
                shown = name or f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"
                info = index.get(name) if name else None
                where = f"layer {layer} expert {expert}"
                _expect(directory, info, where, projection, shape, f"{projection} tensor ({shown})", is_model_dir)


def check_weight_files(
    method: str,
    directory: str,
    layers: Sequence[int],
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    *,
    is_model_dir: bool = False,
) -> None:
    """What kt-kernel will read with ``method`` from ``directory``, checked up front."""
    if method == "BF16":
        check_bf16_experts(directory, layers, num_experts, hidden_size, intermediate_size, is_model_dir=is_model_dir)
    else:
        read_index(directory, is_model_dir=is_model_dir)
