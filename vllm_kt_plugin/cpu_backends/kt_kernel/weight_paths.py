"""What a KT_WEIGHT_PATH holds, and whether a KT_METHOD reads it: one classification of the
path (``classify``: file names and safetensors headers only, fast on a 600 GB folder), one
decision per method and kind (``decide``), then, with the model's config, every file kt-kernel
will read (``check_weight_path``). Serve's config-time checks and ``vllm-kt doctor`` call the
same functions, so both say the same line. kt-kernel 0.7.2 itself would fail in a worker, after
vLLM loaded the GPU weights (AMXINT8 given a checkpoint: ``No experts found for key blk.0``).
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_kt_plugin.cpu_backends.kt_kernel.gguf_files import check_gguf
from vllm_kt_plugin.cpu_backends.kt_kernel.weight_files import check_weight_files
from vllm_kt_plugin.settings.errors import UNSET, KTConfigError
from vllm_kt_plugin.settings.model_memory import ExpertShape

# --- what a path holds ---------------------------------------------------------------------

# What AMXINT4/AMXINT8 (and MOE_INT4/MOE_INT8) read: KTransformers' converted tensors
# (kt_kernel.utils.loader.SafeTensorLoader) where the folder holds any *.safetensors directly,
# else the files their kernels write when they quantize (operators/amx/moe.hpp: T::name() is
# INT4, INT8, MOE_INT4 or MOE_INT8; the byte count in the name is the file's size).
CONVERTED_NAME = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(\d+)\.numa\.(\d+)\.(weight|scale)$")
KT_FILE_NAME = re.compile(
    r"^(?P<type>[A-Z0-9_]+?)_(?P<proj>gate|up|down)_(?P<expert>\d+)_(?P<bytes>\d+)Byte_(?P<part>quant|scale)_\.kt$"
)
# A Hugging Face checkpoint's routed experts, as kt-kernel's loaders name them (DeepSeek/Qwen
# ``mlp.experts``, Mixtral/MiniMax ``block_sparse_moe.experts``, DeepSeek-V4 ``ffn.experts``),
# and the stacked layout (Qwen3.5-MoE: ``mlp.experts.gate_up_proj``).
HF_EXPERT_NAME = re.compile(
    r"^(?:.*\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe|ffn|feed_forward)\.experts\.(\d+)\.(\w+)\.(\w+)$"
)
HF_STACKED_NAME = re.compile(r"^(?:.*\.)?layers\.(\d+)\.mlp\.experts\.gate_up_proj$")
GATE_PROJECTIONS = ("gate_proj", "w1")
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}  # fmt: skip
# kt-kernel's quantized kernels by the type name their files carry, and by bits.
KT_FILE_TYPES = {"INT4": "AMXINT4", "INT8": "AMXINT8", "MOE_INT4": "MOE_INT4", "MOE_INT8": "MOE_INT8"}
BITS = {"AMXINT4": 4, "AMXINT8": 8, "MOE_INT4": 4, "MOE_INT8": 8}
READS_CONVERTED = frozenset(BITS)
MAX_HEADER_BYTES = 256 << 20  # a safetensors header larger than this is no header


@dataclass(frozen=True)
class ConvertedExperts:
    """Quantized experts in kt-kernel's own layout, per layer: (NUMA part, projection,
    weight|scale) -> expert -> bytes; ``short``: files smaller than their names say."""

    layout: str  # "converted" (kt quant's safetensors) or "layer folders" (_layer_N/_numa_M/*.kt)
    methods: frozenset[str]  # the kt-kernel methods whose kernels read these bytes
    layers: Mapping[int, Mapping[tuple[int, str, str], Mapping[int, int]]]
    short: tuple[str, ...] = ()

    @property
    def pools(self) -> int:
        """NUMA parts (kt-kernel's thread pools) it was written for."""
        return 1 + max((numa for parts in self.layers.values() for numa, _, _ in parts), default=-1)

    @property
    def name(self) -> str:
        """The method to name them by: the AMX one where MOE's would read the same bytes
        (kt-kernel 0.7.2's x86 builds have no MOE_INT4/MOE_INT8 kernels)."""
        return min(self.methods, key=lambda m: (m.startswith("MOE"), m), default="unrecognized")


@dataclass(frozen=True)
class Held:
    """What ``path`` holds, as far as kt-kernel's readers care (file names and headers)."""

    path: str
    exists: bool = True
    is_file: bool = False
    gguf: tuple[str, ...] = ()  # .gguf files kt-kernel's LLAMAFILE would read
    hf_format: str | None = None  # the routed experts' format in a Hugging Face checkpoint
    converted: ConvertedExperts | None = None
    top_level_safetensors: bool = False  # what AMX/MOE wrappers test to pick the converted reader
    safetensors: int = 0
    unreadable: tuple[str, ...] = ()  # *.safetensors whose header does not parse
    other_files: tuple[str, ...] = ()  # a few of the names there, when it holds no weights
    nested: tuple[str, ...] = ()  # subfolders that hold weights, when it holds none itself

    @property
    def readers(self) -> frozenset[str]:
        """The methods that read what it holds."""
        found: set[str] = set()
        if self.gguf:
            found.add("LLAMAFILE")
        if self.hf_format is not None:
            found |= {m for m, formats in HF_FORMATS.items() if self.hf_format in formats}
        if self.converted is not None:
            found |= self.converted.methods
        return frozenset(found)

    @property
    def reader(self) -> str | None:
        """The method to suggest for what it holds."""
        order = ("LLAMAFILE", "AMXINT4", "AMXINT8", "BF16", "FP8_PERCHANNEL", *HF_FORMATS, "MOE_INT4", "MOE_INT8")
        preferred = [m for m in order if m in self.readers]
        return preferred[0] if preferred else None

    def describe(self) -> str:
        if not self.exists:
            return "nothing exists there"
        if self.is_file:
            if self.gguf:
                return "a GGUF file"
            return f"a file ({Path(self.path).suffix or 'no suffix'}), not a folder of expert weights"
        parts = []
        if self.converted is not None:
            parts.append(_describe_converted(self.converted))
        if self.hf_format is not None:
            experts = HF_FORMAT_TEXT.get(self.hf_format, self.hf_format)
            parts.append(f"a Hugging Face checkpoint whose routed experts are {experts}")
        if self.gguf:
            parts.append(f"GGUF weights ({', '.join(self.gguf[:3])}{', ...' if len(self.gguf) > 3 else ''})")
        if parts:
            return " and ".join(parts)
        if self.safetensors:
            what = f"{self.safetensors} *.safetensors file(s) without routed-expert tensors kt-kernel reads"
            return what + (f" ({self.unreadable[0]} cannot be read)" if self.unreadable else "")
        if self.other_files:
            shown = ", ".join(self.other_files[:4]) + (", ..." if len(self.other_files) > 4 else "")
            return f"a folder without expert weights (it holds {shown}){self._nested()}"
        return f"an empty folder{self._nested()}"

    def _nested(self) -> str:
        return f"; its subfolder {self.nested[0]} holds weights" if self.nested else ""


def _describe_converted(converted: ConvertedExperts) -> str:
    pools = f"{converted.pools} NUMA pool{'s' if converted.pools != 1 else ''}"
    layers = f"layers {_span(sorted(converted.layers))}"
    if converted.layout == "converted":
        how = "converted by KTransformers (`kt quant`'s blk.N.ffn_*_exps.E.numa.M tensors"
    else:
        how = "as kt-kernel writes them when it quantizes (_layer_N/_numa_M/*.kt"
    return f"{converted.name} experts {how}; {layers}; {pools})"


def _span(values: Sequence[int]) -> str:
    values = sorted(values)
    if values and values == list(range(values[0], values[-1] + 1)) and len(values) > 2:
        return f"{values[0]}..{values[-1]}"
    return ", ".join(map(str, values))


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) from a safetensors file's header (its first 8 bytes
    say how long the JSON header is); the tensor data is never read."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"header of {size} bytes")
        header = json.loads(f.read(size))
    return {
        name: (str(info["dtype"]), tuple(int(n) for n in info["shape"]))
        for name, info in header.items()
        if name != "__metadata__"
    }


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count * DTYPE_BYTES.get(dtype, 1)


def classify(path: str) -> Held:
    """What ``path`` holds (no tensor data is read)."""
    where = Path(path)
    if not where.exists():
        return Held(path, exists=False)
    if where.is_file():
        return Held(path, is_file=True, gguf=(where.name,) if where.suffix == ".gguf" else ())
    entries = sorted(os.listdir(where))
    gguf = tuple(name for name in entries if name.endswith(".gguf") and (where / name).is_file())
    files = [Path(root) / name for root, _, names in os.walk(where) for name in sorted(names)]
    tensors = [f for f in files if f.suffix == ".safetensors"]
    hf_format, converted, unreadable = None, None, []
    if tensors:
        converted_parts: dict[int, dict[tuple[int, str, str], dict[int, int]]] = {}
        hf_experts: dict[str, tuple[str, tuple[int, ...]]] = {}
        for file in tensors:
            try:
                header = safetensors_header(file)
            except (OSError, ValueError, KeyError, TypeError, struct.error):
                unreadable.append(str(file.relative_to(where)))
                continue
            for name, (dtype, shape) in header.items():
                match = CONVERTED_NAME.match(name)
                if match:
                    layer, proj, expert, numa, part = match.groups()
                    parts = converted_parts.setdefault(int(layer), {})
                    parts.setdefault((int(numa), proj, part), {})[int(expert)] = _nbytes(dtype, shape)
                elif HF_EXPERT_NAME.match(name) or HF_STACKED_NAME.match(name):
                    hf_experts[name] = (dtype, shape)
        hf_format = _hf_format(hf_experts) if hf_experts else None
        if converted_parts:
            bits = _bits(converted_parts)
            methods = frozenset(m for m, b in BITS.items() if b == bits) if bits else frozenset()
            converted = ConvertedExperts("converted", methods, converted_parts)
    elif any(name.startswith("_layer_") for name in entries):
        converted = _layer_folders(where)
    nested: tuple[str, ...] = ()
    if not (gguf or tensors or converted):
        nested = tuple(
            name
            for name in entries
            if (where / name).is_dir()
            and any(n.endswith((".gguf", ".safetensors")) or n.startswith("_layer_") for n in os.listdir(where / name))
        )
    return Held(
        path,
        gguf=gguf,
        hf_format=hf_format,
        converted=converted,
        top_level_safetensors=any(f.parent == where for f in tensors),
        safetensors=len(tensors),
        unreadable=tuple(unreadable),
        other_files=tuple(str(f.relative_to(where)) for f in files[:5]),
        nested=nested,
    )


def _bits(layers: Mapping[int, Mapping[tuple[int, str, str], Mapping[int, int]]]) -> int | None:
    """Bits per weight from one expert's bytes alone: gate's scales count its rows (4
    bytes each), down's count the hidden size, so gate's weight holds rows x hidden
    values of ``bits`` each."""
    parts = layers[min(layers)]
    try:
        gate = parts[(0, "gate", "weight")][0]
        rows = parts[(0, "gate", "scale")][0] // 4
        hidden = parts[(0, "down", "scale")][0] // 4
    except KeyError:
        return None
    return 8 * gate // (rows * hidden) if rows and hidden and (8 * gate) % (rows * hidden) == 0 else None


def _layer_folders(where: Path) -> ConvertedExperts | None:
    """``_layer_N/_numa_M/*.kt`` as kt-kernel writes them (the plugin's KT_CACHE_DIR, or
    ``kt quant --no-merge``): names, and each file's size against the one in its name."""
    layers: dict[int, dict[tuple[int, str, str], dict[int, int]]] = {}
    types: set[str] = set()
    short: list[str] = []
    for layer_dir in where.glob("_layer_*"):
        if not layer_dir.is_dir() or not layer_dir.name[7:].isdigit():
            continue
        parts = layers.setdefault(int(layer_dir.name[7:]), {})
        for numa_dir in layer_dir.glob("_numa_*"):
            if not numa_dir.name[6:].isdigit():
                continue
            numa = int(numa_dir.name[6:])
            for entry in os.scandir(numa_dir):
                match = KT_FILE_NAME.match(entry.name)
                if match is None:
                    continue
                types.add(match["type"])
                size = int(match["bytes"])
                part = "weight" if match["part"] == "quant" else "scale"
                parts.setdefault((numa, match["proj"], part), {})[int(match["expert"])] = size
                if entry.stat().st_size != size:
                    short.append(str(Path(entry.path).relative_to(where)))
    if not layers:
        return None
    methods = frozenset(KT_FILE_TYPES[t] for t in types if t in KT_FILE_TYPES)
    return ConvertedExperts("layer folders", methods, layers, tuple(sorted(short)))


# --- Hugging Face checkpoints: the routed experts' format ---------------------------------

# method -> the checkpoint formats its reader takes (kt_kernel.utils.loader's readers).
HF_FORMATS: dict[str, frozenset[str]] = {
    "BF16": frozenset({"BF16"}),
    "FP8": frozenset({"block-FP8", "per-channel FP8"}),
    "FP8_PERCHANNEL": frozenset({"per-channel FP8"}),
    "GPTQ_INT4": frozenset({"GPTQ-INT4"}),
    "SYCL_GPTQ_INT4": frozenset({"GPTQ-INT4"}),
    "RAWINT4": frozenset({"compressed-tensors-INT4"}),
    "MXFP4": frozenset({"MXFP4"}),
    "NVFP4": frozenset({"NVFP4"}),
    "MXFP8": frozenset({"MXFP8"}),
}
HF_FORMAT_TEXT = {
    "BF16": "BF16",
    "FP16": "FP16 (no kt-kernel method reads them as they are)",
    "FP32": "FP32 (no kt-kernel method reads them as they are)",
    "block-FP8": "block-FP8 (F8_E4M3 weight, weight_scale_inv per 128 x 128 block)",
    "per-channel FP8": "per-channel FP8 (F8_E4M3 weight, a scale per row)",
    "GPTQ-INT4": "GPTQ INT4 (qweight, scales)",
    "compressed-tensors-INT4": "compressed-tensors pack-quantized INT4 (weight_packed, weight_scale)",
    "MXFP4": "MXFP4 (E2M1 weight, ue8m0 scale)",
    "NVFP4": "NVFP4 (E2M1 weight, weight_scale, weight_scale_2)",
    "MXFP8": "MXFP8 (F8_E4M3 weight, ue8m0 weight_scale_inv)",
}


def _hf_format(experts: Mapping[str, tuple[str, tuple[int, ...]]]) -> str:
    """The format of the routed experts: from the tensors of the first expert's gate."""
    stacked = sorted(name for name in experts if HF_STACKED_NAME.match(name))
    if stacked:
        return _plain(experts[stacked[0]][0])
    gates = sorted(
        (int(m[1]), int(m[2]), m[3], m[4])
        for name in experts
        if (m := HF_EXPERT_NAME.match(name)) and m[3] in GATE_PROJECTIONS
    )
    if not gates:
        return "unrecognized (no gate_proj/w1 of any expert)"
    layer, expert, projection = gates[0][:3]
    prefix = next(
        n for n in experts if (m := HF_EXPERT_NAME.match(n)) and m.groups()[:3] == (str(layer), str(expert), projection)
    )
    base = prefix.rsplit(".", 1)[0]
    tensors = {name.rsplit(".", 1)[1]: info for name, info in experts.items() if name.rsplit(".", 1)[0] == base}
    if "qweight" in tensors:
        return "GPTQ-INT4"
    if "weight_packed" in tensors:
        return "compressed-tensors-INT4"
    weight_dtype = tensors.get("weight", ("?", ()))[0]
    if weight_dtype == "F8_E4M3":
        inverse = tensors.get("weight_scale_inv")
        if inverse is not None:
            if inverse[0] in ("U8", "F8_E8M0"):
                return "MXFP8"
            out = tensors["weight"][1][0]
            return "per-channel FP8" if inverse[1] in ((out,), (out, 1)) else "block-FP8"
        return "per-channel FP8" if "weight_scale" in tensors else "unrecognized (F8_E4M3 weight without scales)"
    if "weight_scale_2" in tensors or tensors.get("weight_scale", ("",))[0] == "F8_E4M3":
        return "NVFP4"
    if "scale" in tensors and weight_dtype in ("I8", "U8"):
        return "MXFP4"
    return _plain(weight_dtype) if weight_dtype != "?" else f"unrecognized ({', '.join(sorted(tensors))})"


def _plain(dtype: str) -> str:
    return {"BF16": "BF16", "F16": "FP16", "F32": "FP32"}.get(dtype, f"unrecognized ({dtype} weights)")


# --- what each method reads, and the one decision per method and kind ---------------------

KT_QUANT = {"AMXINT4": "kt quant --method int4", "AMXINT8": "kt quant --method int8"}


def needs(method: str) -> str:
    """What ``method`` reads from KT_WEIGHT_PATH, as a user would look for it."""
    if method == "LLAMAFILE":
        return "GGUF weights (llama.cpp's blk.N.ffn_*_exps tensors)"
    if method in READS_CONVERTED:
        how = (
            f"`{KT_QUANT[method]}` output, <model>-{method}-NUMA<n>" if method in KT_QUANT else "converted by kt-kernel"
        )
        return f"{method} experts converted by kt-kernel ({how}) or quantized by it (_layer_N/_numa_M/*.kt)"
    formats = " or ".join(HF_FORMAT_TEXT[f] for f in sorted(HF_FORMATS.get(method, ())))
    return f"a Hugging Face checkpoint's *.safetensors whose routed experts are {formats or method}"


def _folder_of(method: str) -> str:
    """Where ``method``'s weights come from, as the "allowed" part of a refusal says it."""
    if method == "LLAMAFILE":
        return (
            "a .gguf file of this model (llama.cpp's, e.g. Q4_K_M or Q8_0), the first file of a split set, or a "
            "folder holding one model's GGUF"
        )
    if method in KT_QUANT:
        return f"a folder of {method} experts (`{KT_QUANT[method]}` output)"
    if method in READS_CONVERTED:
        return f"a folder of {method} experts converted by kt-kernel"
    return f"a folder of {method} expert tensors"


@dataclass(frozen=True)
class Checkpoint:
    """The model's own checkpoint, as far as the advice needs it: its format (None when
    unquantized) and the kt-kernel method that reads it (None when none does)."""

    quant_method: str | None = None
    own_method: str | None = None


def decide(method: str, held: Held, *, pools: int, checkpoint: Checkpoint | None = None) -> KTConfigError | None:
    """Whether ``method`` can read what ``held`` holds (KT_WEIGHT_PATH set): None, or the
    refusal naming what it holds, what the method reads and what to do."""
    if not held.exists or (held.is_file and not held.gguf):
        # the settings parser's own line (it refuses these first in serve; doctor reads the raw value)
        return KTConfigError("KT_WEIGHT_PATH", held.path, "no such directory" if not held.exists else "not a directory")
    if method in held.readers:
        if method in READS_CONVERTED:
            return _converted_layout(method, held, pools)
        return None
    return _refusal(
        held, f"{held.describe()}; KT_METHOD={method} reads {needs(method)}", _advice(method, held, checkpoint)
    )


def _advice(method: str, held: Held, checkpoint: Checkpoint | None) -> list[str]:
    """What to do, the smallest change first: for the model's own BF16 checkpoint and an AMX
    method, quantizing it online; a method that reads these weights; the default source
    (KT_WEIGHT_PATH unset) where it serves this method; where the method's weights come from."""
    unset = None
    if checkpoint is not None and method in KT_QUANT and checkpoint.quant_method is None:
        unset = (
            f"KT_WEIGHT_PATH unset, to quantize the checkpoint to {method} at the first start (kept in KT_CACHE_DIR)"
        )
    elif checkpoint is not None and method == checkpoint.own_method:
        unset = "KT_WEIGHT_PATH unset, to read the model's own checkpoint"
    options = [unset] if unset and held.hf_format is not None else []
    if held.reader is not None:
        options.append(f"KT_METHOD={held.reader} for these weights")
    return [*options, *([unset] if unset else []), _folder_of(method)]


def _refusal(held: Held, reason: str, options: list[str]) -> KTConfigError:
    return KTConfigError("KT_WEIGHT_PATH", held.path, reason, ", or ".join(dict.fromkeys(options)))


def _converted_layout(method: str, held: Held, pools: int) -> KTConfigError | None:
    """AMX/MOE experts: the reader kt-kernel picks (converted safetensors when any lie
    directly in the folder, else the layer folders) and the NUMA pools they were written for."""
    converted = held.converted
    assert converted is not None
    if converted.layout == "converted" and not held.top_level_safetensors:
        return _refusal(
            held,
            f"{held.describe()}, in subfolders: kt-kernel reads them only from *.safetensors directly in the folder",
            [f"the folder that holds the *.safetensors files, or {_folder_of(method)}"],
        )
    if converted.pools != pools:
        return _refusal(
            held,
            f"{held.describe()}; kt-kernel reads one NUMA part per thread pool, and KT_THREADPOOL_COUNT is {pools}",
            [
                f"KT_THREADPOOL_COUNT={converted.pools} (one pool per NUMA node, where the machine has "
                f"{converted.pools})",
                f"{method} experts converted for {pools} NUMA pool{'s' if pools != 1 else ''}"
                + (f" (`{KT_QUANT[method]} --numa-nodes {pools}`)" if method in KT_QUANT else ""),
            ],
        )
    return None


# --- with the model's config: every layer, expert and size ---------------------------------


def part_bytes(method: str, hidden: int, inter: int, pools: int) -> dict[tuple[str, str], int]:
    """Bytes of one expert's (projection, weight|scale) in one NUMA part: each part holds
    inter/pools rows of gate and up, and as many columns of down (kt-kernel's
    ``intermediate_size /= tp_count``); weights ``bits`` each, one float32 scale per row."""
    rows, bits = inter // pools, BITS[method]
    return {
        ("gate", "weight"): rows * hidden * bits // 8,
        ("up", "weight"): rows * hidden * bits // 8,
        ("down", "weight"): hidden * rows * bits // 8,
        ("gate", "scale"): rows * 4,
        ("up", "scale"): rows * 4,
        ("down", "scale"): hidden * 4,
    }


def check_layers(method: str, held: Held, model: ExpertShape, pools: int) -> KTConfigError | None:
    """Converted experts: every MoE layer of the model, every NUMA part, every expert's
    weights and scales, of the model's sizes (kt-kernel would read past a smaller buffer)."""
    converted = held.converted
    if converted is None or method not in READS_CONVERTED:
        return None
    redo = (
        f"a complete conversion of this model (`{KT_QUANT[method]} --numa-nodes {pools}`)"
        if method in KT_QUANT
        else f"a complete {method} conversion of this model"
    ) + ", or KT_WEIGHT_PATH unset to quantize a BF16 checkpoint at the first start"
    missing = [layer for layer in model.moe_layers if layer not in converted.layers]
    if missing:
        reason = (
            f"{held.describe()}; this model's MoE layers are {_span(model.moe_layers)}: layer {_span(missing)} "
            "missing (an interrupted conversion, or another model's?)"
        )
        return _refusal(held, reason, [redo])
    if converted.short:
        return _refusal(held, f"{converted.short[0]} is shorter than its name says (cut short: a full disk?)", [redo])
    expected = part_bytes(method, model.hidden_size, model.intermediate_size, pools)
    for layer in model.moe_layers:
        parts = converted.layers[layer]
        for numa in range(pools):
            for (proj, part), size in expected.items():
                experts = parts.get((numa, proj, part), {})
                absent = [e for e in range(model.num_experts) if e not in experts]
                if absent:
                    reason = f"layer {layer} NUMA part {numa}: no {proj} {part} of expert {absent[0]}"
                    return _refusal(held, f"{reason} (of {model.num_experts} experts)", [redo])
                wrong = [e for e in range(model.num_experts) if experts[e] != size]
                if wrong:
                    found = experts[wrong[0]]
                    reason = (
                        f"layer {layer} NUMA part {numa}: expert {wrong[0]}'s {proj} {part} is {found} bytes; "
                        f"{method} experts of this model (hidden {model.hidden_size}, expert width "
                        f"{model.intermediate_size}, {pools} NUMA part{'s' if pools != 1 else ''}) have {size}: "
                        "converted from another model?"
                    )
                    return _refusal(held, reason, [redo])
    return None


# --- KT_WEIGHT_PATH unset ------------------------------------------------------------------


def check_default(method: str, checkpoint: Checkpoint) -> KTConfigError | None:
    """KT_WEIGHT_PATH unset: the model's own checkpoint is read, or for AMXINT4/AMXINT8
    quantized from the BF16/FP16 tensors vLLM loads; other methods need a path."""
    stored = checkpoint.quant_method or "unquantized"
    own = checkpoint.own_method
    if method == "LLAMAFILE":
        return KTConfigError(
            "KT_WEIGHT_PATH", UNSET, "KT_METHOD=LLAMAFILE reads the CPU experts from GGUF files", _folder_of(method)
        )
    if method in KT_QUANT:
        if checkpoint.quant_method is None:
            return None
        convert = f"`{KT_QUANT[method]} --input-type fp8`" if stored.startswith("fp8") else f"`{KT_QUANT[method]}`"
        return KTConfigError(
            "KT_METHOD",
            method,
            f"KT_WEIGHT_PATH is unset, so the CPU experts would be quantized online from the checkpoint's tensors, "
            f"which are {stored}, not BF16/FP16",
            ", or ".join(
                ([f"KT_METHOD={own} (or unset) for this checkpoint"] if own else [])
                + [f"KT_WEIGHT_PATH set to {method} experts converted from it ({convert})"]
            ),
        )
    if method in READS_CONVERTED:
        return KTConfigError(
            "KT_WEIGHT_PATH",
            UNSET,
            f"KT_METHOD={method} reads kt-kernel's converted weights, which the model directory does not hold",
            f"{_folder_of(method)}, or a KT_METHOD that reads the checkpoint",
        )
    if method == own:
        return None
    return KTConfigError(
        "KT_METHOD",
        method,
        f"KT_WEIGHT_PATH is unset, so kt-kernel would read the model's own {stored} weights, which {method} cannot",
        (f"KT_METHOD={own} (or unset), or " if own else "")
        + f"KT_METHOD={method} with KT_WEIGHT_PATH set to {_folder_of(method)}",
    )


# --- the checks serve and doctor run ---------------------------------------------------------


def check_weight_path(
    method: str,
    path: str,
    *,
    pools: int,
    checkpoint: Checkpoint | None = None,
    model: ExpertShape | None = None,
    variant: str | None = None,
) -> Held:
    """KT_WEIGHT_PATH=``path`` against ``method`` (KTConfigError, else what it holds); with
    the ``model``'s experts, every file kt-kernel will read: each GGUF tensor (``variant``:
    the kt-kernel build, whose LLAMAFILE types differ), each checkpoint tensor, each layer of
    converted experts."""
    held = classify(path)
    refusal = decide(method, held, pools=pools, checkpoint=checkpoint)
    if refusal is not None:
        raise refusal
    if model is None:
        return held
    shape = (model.moe_layers, model.num_experts, model.hidden_size, model.intermediate_size)
    if method == "LLAMAFILE":
        check_gguf(path, *shape, variant or "avx2")  # unknown build: the types every build computes
    elif method in READS_CONVERTED:
        refusal = check_layers(method, held, model, pools)
        if refusal is not None:
            raise refusal
    else:
        check_weight_files(method, path, *shape)
    return held


def check_model_directory(method: str, model_dir: str, model: ExpertShape | None = None) -> None:
    """KT_WEIGHT_PATH unset, a method that reads the checkpoint: the model directory's
    files (every expert tensor, with the ``model``'s experts)."""
    held = classify(model_dir)
    if not held.safetensors:
        raise KTConfigError(
            "KT_WEIGHT_PATH",
            UNSET,
            f"so kt-kernel reads the model directory {model_dir}: {held.describe()}, no *.safetensors for "
            f"KT_METHOD={method}",
            "set KT_WEIGHT_PATH to a directory with the CPU expert weights",
        )
    if model is not None:
        shape = (model.moe_layers, model.num_experts, model.hidden_size, model.intermediate_size)
        check_weight_files(method, model_dir, *shape, is_model_dir=True)
