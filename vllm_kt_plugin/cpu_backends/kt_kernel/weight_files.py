"""What kt-kernel will read from KT_WEIGHT_PATH (or the model directory), checked before
it reads it.

kt-kernel 0.7.2's safetensors loaders trust the files (docs/design.md, "Reliability"), so
every file is opened here and, for the methods that read a Hugging Face checkpoint's own
experts (BF16, FP8, RAWINT4, GPTQ_INT4), every CPU-expert tensor the loader will look up is
checked for presence, dtype and shape, with one error naming the layer, the expert and
the file. For the other methods the files are checked to open."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_kt_plugin.settings.errors import KTConfigError

# kt-kernel's loaders' names (kt_kernel.utils.loader, MOE_FORMATS): experts under
# "<layer>.mlp.experts" (DeepSeek, Qwen) or "<layer>.block_sparse_moe.experts" (Mixtral),
# with these projection names for gate, up and down.
EXPERT_LAYOUTS = (
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


FP8_BLOCK = 128  # kt-kernel's FP8 kernel reads 128 x 128 block scales


def fp8_blocks(size: int) -> int:
    """Scale blocks along a dimension of ``size`` (the last one partial)."""
    return -(-size // FP8_BLOCK)


def _fp8_scale_shape(out: int, inn: int, shape: tuple[int, ...]) -> bool:
    """Block scales (one per 128 x 128 block) or per-channel ones ([out] or [out, 1])."""
    blocks = (fp8_blocks(out), fp8_blocks(inn))
    return shape in (blocks, (out,), (out, 1))


def _group_columns(out: int, inn: int, shape: tuple[int, ...]) -> bool:
    """[out, inn / group]: one scale per group of inputs, for each output."""
    return len(shape) == 2 and shape[0] == out and shape[1] > 0 and inn % shape[1] == 0


def _group_rows(out: int, inn: int, shape: tuple[int, ...]) -> bool:
    """[inn / group, out], GPTQ's transposed layout."""
    return len(shape) == 2 and shape[1] == out and shape[0] > 0 and inn % shape[0] == 0


@dataclass(frozen=True)
class Expected:
    """One tensor kt-kernel reads per expert projection of weight shape [out, in]: its name
    suffix, dtypes, and its shape as an exact function of (out, in) or a rule with the
    shape it describes."""

    suffix: str
    dtypes: tuple[str, ...]
    exact: Callable[[int, int], tuple[int, ...]] | None = None
    rule: Callable[[int, int, tuple[int, ...]], bool] | None = None
    described: str = ""

    def fits(self, out: int, inn: int, shape: tuple[int, ...]) -> bool:
        if self.exact is not None:
            return shape == self.exact(out, inn)
        assert self.rule is not None
        return self.rule(out, inn, shape)

    def shown(self, out: int, inn: int) -> str:
        if self.exact is not None:
            return f"{'/'.join(self.dtypes)} {list(self.exact(out, inn))}"
        blocks = {"blocks_out": fp8_blocks(out), "blocks_in": fp8_blocks(inn)}
        return f"{'/'.join(self.dtypes)} {self.described.format(out=out, inn=inn, **blocks)}"


# What each method reads per projection (kt_kernel.utils.loader: BF16SafeTensorLoader,
# FP8SafeTensorLoader, CompressedSafeTensorLoader, GPTQSafeTensorLoader). The first entry
# names the projection's tensor that shows which layout a checkpoint uses.
METHOD_TENSORS: dict[str, tuple[Expected, ...]] = {
    "BF16": (Expected("weight", ("BF16",), exact=lambda o, i: (o, i)),),
    "FP8": (
        Expected("weight", ("F8_E4M3",), exact=lambda o, i: (o, i)),
        Expected(
            "weight_scale_inv",
            ("F32", "BF16"),
            rule=_fp8_scale_shape,
            described="[{blocks_out}, {blocks_in}] (or [{out}] per channel)",
        ),
    ),
    "RAWINT4": (
        Expected("weight_packed", ("I32",), exact=lambda o, i: (o, i // 8)),
        Expected("weight_scale", ("BF16", "F16", "F32"), rule=_group_columns, described="[{out}, {inn}/group]"),
    ),
    "GPTQ_INT4": (
        Expected("qweight", ("I32",), exact=lambda o, i: (i // 8, o)),
        Expected("scales", ("F16", "BF16", "F32"), rule=_group_rows, described="[{inn}/group, {out}]"),
    ),
}


def _layout(layer: int, index: dict[str, TensorInfo], probe: str) -> tuple[str, tuple[str, ...]] | None:
    """The experts prefix and gate/up/down names the checkpoint uses for ``layer``."""
    for prefix_template in LAYER_PREFIXES:
        prefix = prefix_template.format(layer)
        for experts, projections in EXPERT_LAYOUTS:
            base = f"{prefix}{experts}"
            if f"{base}.0.{projections[0]}.{probe}" in index:
                return base, projections
    return None


def _packed_experts(layer: int, index: dict[str, TensorInfo]) -> str | None:
    """The "<layer>.mlp.experts" prefix where the layer stores all experts in two stacked
    tensors (gate_up_proj, down_proj; Qwen3.5-MoE), which kt-kernel also reads."""
    for prefix_template in LAYER_PREFIXES:
        base = f"{prefix_template.format(layer)}.mlp.experts"
        if f"{base}.gate_up_proj" in index:
            return base
    return None


def _check_tensor(
    directory: str,
    index: dict[str, TensorInfo],
    name: str,
    where: str,
    label: str,
    expected: Expected,
    out_in: tuple[int, int],
    is_model_dir: bool,
) -> None:
    info = index.get(name)
    if info is None:
        raise _bad(directory, f"{where}: no {label} tensor ({name}) in any *.safetensors file", is_model_dir)
    if info.dtype not in expected.dtypes or not expected.fits(*out_in, info.shape):
        reason = (
            f"{where}: {label} in {info.file} is {info.dtype} {list(info.shape)}, expected {expected.shown(*out_in)}"
        )
        raise _bad(directory, reason, is_model_dir)


def check_expert_tensors(
    method: str,
    directory: str,
    layers: Sequence[int],
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    *,
    is_model_dir: bool = False,
    index: Mapping[str, TensorInfo] | None = None,
) -> None:
    """Every routed expert of every MoE layer present in ``method``'s tensors, of the
    model's shapes: gate and up [intermediate, hidden], down [hidden, intermediate].
    ``index``: the directory's ``read_index``, where the caller has it already."""
    expected = METHOD_TENSORS[method]
    if index is None:
        index = read_index(directory, is_model_dir=is_model_dir)
    h, i, e = hidden_size, intermediate_size, num_experts
    for layer in layers:
        packed = _packed_experts(layer, index) if method == "BF16" else None
        if packed is not None:
            for name, shape in ((f"{packed}.gate_up_proj", (e, 2 * i, h)), (f"{packed}.down_proj", (e, h, i))):
                stacked = Expected("", ("BF16",), exact=lambda o, n, shape=shape: shape)
                _check_tensor(directory, index, name, f"layer {layer}", name, stacked, (0, 0), is_model_dir)
            continue
        base, projections = _layout(layer, index, expected[0].suffix) or (
            f"model.layers.{layer}.mlp.experts",
            EXPERT_LAYOUTS[0][1],
        )
        for expert in range(num_experts):
            for projection, out_in in zip(projections, ((i, h), (i, h), (h, i)), strict=True):
                for tensor in expected:
                    name = f"{base}.{expert}.{projection}.{tensor.suffix}"
                    label = (
                        projection
                        if tensor.suffix in ("weight", expected[0].suffix)
                        else f"{projection}.{tensor.suffix}"
                    )
                    if tensor.suffix == "weight_scale_inv" and name not in index:
                        name = name.removesuffix("_inv")  # FP8 per-channel (or Mistral's block) scales
                    where = f"layer {layer} expert {expert}"
                    _check_tensor(directory, index, name, where, label, tensor, out_in, is_model_dir)


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
    if method in METHOD_TENSORS:
        check_expert_tensors(
            method, directory, layers, num_experts, hidden_size, intermediate_size, is_model_dir=is_model_dir
        )
    else:
        read_index(directory, is_model_dir=is_model_dir)
