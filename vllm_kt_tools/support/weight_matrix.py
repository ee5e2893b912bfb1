"""KT_WEIGHT_PATH against KT_METHOD: every kind of path a user may give, crossed with every
method kt-kernel 0.7.2's x86 builds offer, and what serve does with each pair: serve, or
stop at config time with one line whose first fix is given here.

``tests/unit/test_weight_paths.py`` builds each kind (``build``) beside a tiny Qwen3-MoE
and runs serve's config-time checks on every pair; docs/settings.md renders this table
(``render``), so the document says what the tests check. Where a pair serves, ``SERVED_BY``
names the end-to-end test that compares its tokens with plain vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SERVES = "serves"
# Every inference method of kt-kernel 0.7.2 that one of its x86 builds carries a kernel for
# (MOE_INT4/MOE_INT8 are its ARM builds', SYCL_GPTQ_INT4 an Intel GPU's: refused by the kernel
# check on every CI machine, before any path is looked at).
METHODS = (
    "BF16",
    "FP8",
    "FP8_PERCHANNEL",
    "GPTQ_INT4",
    "RAWINT4",
    "MXFP4",
    "NVFP4",
    "MXFP8",
    "AMXINT4",
    "AMXINT8",
    "LLAMAFILE",
)
NUMA = 1  # KT_THREADPOOL_COUNT in every case (the default)


@dataclass(frozen=True)
class Kind:
    name: str
    text: str  # the row's label in docs/settings.md
    checkpoint: str = "bf16"  # the model vllm serve is given: "bf16", or "fp8" (block-FP8)


KINDS = (
    Kind("unset", "unset, on a BF16 checkpoint"),
    Kind("unset-fp8", "unset, on a block-FP8 checkpoint", "fp8"),
    Kind("hf-bf16", "the model's own folder (BF16 checkpoint)"),
    Kind("hf-fp8", "the model's own folder (block-FP8 checkpoint)", "fp8"),
    Kind("cache-amxint4", "AMXINT4 experts as the online cache writes them (`_layer_N/_numa_M/INT4_*.kt`)"),
    Kind("cache-amxint8", "AMXINT8 experts as the online cache writes them (`_layer_N/_numa_M/INT8_*.kt`)"),
    Kind("kt-quant-amxint4", "`kt quant --method int4` output (`<model>-AMXINT4-NUMA1`)"),
    Kind("kt-quant-amxint8", "`kt quant --method int8` output (`<model>-AMXINT8-NUMA1`)"),
    Kind("kt-quant-numa2", "`kt quant --method int8` output for 2 NUMA nodes (`<model>-AMXINT8-NUMA2`)"),
    Kind("kt-quant-partial", "`kt quant --method int8` output with a layer missing (an interrupted conversion)"),
    Kind("gguf-file", "a GGUF file (Q8_0)"),
    Kind("gguf-folder", "a folder holding a GGUF split set"),
    Kind("empty", "an empty folder"),
    Kind("missing", "a path where nothing exists"),
    Kind("file", "a file that is not GGUF"),
)
BY_NAME = {kind.name: kind for kind in KINDS}

# kind -> method -> what serve does: SERVES, or the start of the "allowed" part of its line
# (the first fix it offers); "*" for every method not named.
EXPECTED: dict[str, dict[str, str]] = {
    "unset": {"BF16": SERVES, "AMXINT4": SERVES, "AMXINT8": SERVES, "LLAMAFILE": "a .gguf file", "*": "KT_METHOD=BF16"},
    "unset-fp8": {"FP8": SERVES, "LLAMAFILE": "a .gguf file", "*": "KT_METHOD=FP8"},
    "hf-bf16": {
        "BF16": SERVES,
        "AMXINT4": "KT_WEIGHT_PATH unset",
        "AMXINT8": "KT_WEIGHT_PATH unset",
        "*": "KT_METHOD=BF16",
    },
    "hf-fp8": {"FP8": SERVES, "*": "KT_METHOD=FP8"},
    "cache-amxint4": {"AMXINT4": SERVES, "*": "KT_METHOD=AMXINT4"},
    "cache-amxint8": {"AMXINT8": SERVES, "*": "KT_METHOD=AMXINT8"},
    "kt-quant-amxint4": {"AMXINT4": SERVES, "*": "KT_METHOD=AMXINT4"},
    "kt-quant-amxint8": {"AMXINT8": SERVES, "*": "KT_METHOD=AMXINT8"},
    "kt-quant-numa2": {"AMXINT8": "KT_THREADPOOL_COUNT=2", "*": "KT_METHOD=AMXINT8"},
    "kt-quant-partial": {"AMXINT8": "a complete conversion", "*": "KT_METHOD=AMXINT8"},
    "gguf-file": {"LLAMAFILE": SERVES, "*": "KT_METHOD=LLAMAFILE"},
    "gguf-folder": {"LLAMAFILE": SERVES, "*": "KT_METHOD=LLAMAFILE"},
    "empty": {
        "BF16": "KT_WEIGHT_PATH unset",
        "AMXINT4": "KT_WEIGHT_PATH unset",
        "AMXINT8": "KT_WEIGHT_PATH unset",
        "LLAMAFILE": "a .gguf file",
        "*": "a folder of {method} expert tensors",
    },
    # the settings parser refuses these, before any method is known
    "missing": {"*": "an existing directory"},
    "file": {"*": "an existing directory"},
}

# The line serve stopped the report that started this with (issue 48: AMXINT8, KT_WEIGHT_PATH the
# model's own BF16 folder; kt-kernel once failed in a worker with "No experts found for key blk.0").
REPORTED = (
    "KT_WEIGHT_PATH={path!r} is invalid (a Hugging Face checkpoint whose routed experts are BF16; KT_METHOD=AMXINT8 "
    "reads AMXINT8 experts converted by kt-kernel (`kt quant --method int8` output, <model>-AMXINT8-NUMA<n>) or "
    "quantized by it (_layer_N/_numa_M/*.kt)); allowed: KT_WEIGHT_PATH unset, to quantize the checkpoint to AMXINT8 "
    "at the first start (kept in KT_CACHE_DIR), or KT_METHOD=BF16 for these weights, or a folder of AMXINT8 experts "
    "(`kt quant --method int8` output)."
)

ENGINE_E2E = "tests/engine/test_engine_e2e.py"
AGAINST_PLAIN = "tokens against plain vLLM's"
# (kind, method) -> the test that serves it end to end, and what that test compares.
SERVED_BY = {
    ("unset", "BF16"): (f"{ENGINE_E2E}::test_kt_kernel_bf16_tokens_equal_plain_vllm", AGAINST_PLAIN),
    ("unset", "AMXINT4"): (f"{ENGINE_E2E}::test_amx_experts_from_every_source_track_plain_vllm", AGAINST_PLAIN),
    ("unset", "AMXINT8"): (f"{ENGINE_E2E}::test_online_amx_weights_are_cached_and_track_plain_vllm", AGAINST_PLAIN),
    ("unset-fp8", "FP8"): (
        "tests/engine/test_quantized_gpu.py::test_quantized_checkpoint_against_plain_vllm",
        f"{AGAINST_PLAIN}, on a GPU: vLLM's CPU build has no block-FP8 kernel",
    ),
    ("hf-bf16", "BF16"): (
        f"{ENGINE_E2E}::test_kt_kernel_bf16_tokens_equal_plain_vllm",
        f"{AGAINST_PLAIN}; its all-on-CPU runs name the model's folder",
    ),
    ("hf-fp8", "FP8"): (
        "tests/engine/test_quantized_checkpoints.py::test_kt_kernel_reads_the_checkpoint",
        "kt-kernel's output from the folder against the dequantized experts; tokens on a GPU, path unset: "
        "test_quantized_gpu.py",
    ),
    ("cache-amxint4", "AMXINT4"): (
        f"{ENGINE_E2E}::test_amx_experts_from_every_source_track_plain_vllm",
        "tokens equal to the online start's",
    ),
    ("cache-amxint8", "AMXINT8"): (
        f"{ENGINE_E2E}::test_online_amx_weights_are_cached_and_track_plain_vllm",
        "tokens equal to the online start's",
    ),
    ("kt-quant-amxint4", "AMXINT4"): (
        f"{ENGINE_E2E}::test_amx_experts_from_every_source_track_plain_vllm",
        "tokens equal to the online start's",
    ),
    ("kt-quant-amxint8", "AMXINT8"): (
        f"{ENGINE_E2E}::test_online_amx_weights_are_cached_and_track_plain_vllm",
        "tokens equal to the online start's",
    ),
    ("gguf-file", "LLAMAFILE"): ("tests/engine/test_gguf_e2e.py::test_gguf_experts_track_plain_vllm", AGAINST_PLAIN),
    ("gguf-folder", "LLAMAFILE"): ("tests/engine/test_gguf_e2e.py::test_gguf_experts_track_plain_vllm", AGAINST_PLAIN),
}


def expected(kind: str, method: str) -> str:
    outcomes = EXPECTED[kind]
    return outcomes.get(method, outcomes["*"]).format(method=method)


def cases() -> list[tuple[str, str]]:
    return [(kind.name, method) for kind in KINDS for method in METHODS]


@dataclass(frozen=True)
class Models:
    bf16: Path  # a tiny Qwen3-MoE (hidden and expert width 256: every method's sizes fit)
    fp8: Path  # the same, block-FP8


def write_models(root: Path) -> Models:
    """The two checkpoints, untrained (the config-time checks read names and headers)."""
    from vllm_kt_tools.support.quantized_checkpoints import write_quantized_checkpoint
    from vllm_kt_tools.support.tiny_models import write_tiny_model

    bf16 = root / "tiny-qwen3-moe"
    if not (bf16 / "TINY_MODEL.json").exists():
        write_tiny_model("qwen3_moe", bf16, train_steps=0, gguf_experts=True)
    fp8 = root / "tiny-qwen3-moe-fp8"
    if not (fp8 / "QUANTIZED.json").exists():
        write_quantized_checkpoint(bf16, fp8, "fp8-block")
    return Models(bf16, fp8)


def build(root: Path, models: Models, *, quantize: frozenset[str] = frozenset()) -> dict[str, str | None]:
    """Each kind's KT_WEIGHT_PATH under ``root`` (None: unset). The AMX layer folders are
    quantized by kt-kernel for the methods in ``quantize`` (where this CPU has the kernel),
    else written with the same names and sizes; the converted folders are made from them."""
    from vllm_kt_tools.support.gguf_export import export_gguf
    from vllm_kt_tools.support.kt_weight_layouts import convert_layers, fake_layers, quantize_layers

    paths: dict[str, str | None] = {"unset": None, "unset-fp8": None}
    paths["hf-bf16"], paths["hf-fp8"] = str(models.bf16), str(models.fp8)
    for method in ("AMXINT4", "AMXINT8"):
        if method in quantize:
            layers = quantize_layers(models.bf16, root / "kt-cache", method, NUMA)
        else:
            layers = fake_layers(models.bf16, root / "kt-cache" / f"{method}-pools{NUMA}", method, NUMA)
        paths[f"cache-{method.lower()}"] = str(layers)
        paths[f"kt-quant-{method.lower()}"] = str(convert_layers(layers, models.bf16, root / "converted", method, NUMA))
    numa2 = fake_layers(models.bf16, root / "numa2-layers", "AMXINT8", 2)
    paths["kt-quant-numa2"] = str(convert_layers(numa2, models.bf16, root / "converted-numa2", "AMXINT8", 2))
    last = max(int(p.name[7:]) for p in Path(paths["cache-amxint8"]).glob("_layer_*"))
    paths["kt-quant-partial"] = str(
        convert_layers(Path(paths["cache-amxint8"]), models.bf16, root / "partial", "AMXINT8", NUMA, stop_at=last)
    )
    (gguf_file,) = export_gguf(models.bf16, root / "gguf-file" / "tiny-qwen3-moe-Q8_0.gguf", "Q8_0")
    paths["gguf-file"] = str(gguf_file)
    export_gguf(models.bf16, root / "gguf-folder" / "tiny-qwen3-moe-Q8_0.gguf", "Q8_0", splits=2)
    paths["gguf-folder"] = str(root / "gguf-folder")
    (root / "empty").mkdir(exist_ok=True)
    paths["empty"] = str(root / "empty")
    paths["missing"] = str(root / "no-such-folder")
    (root / "notes.txt").write_text("the experts are elsewhere\n")
    paths["file"] = str(root / "notes.txt")
    return paths


def render() -> str:
    """The matrix as docs/settings.md shows it: per kind of path, the methods that serve,
    and for the others the first fix of the line serve stops with."""
    rows = [
        "| KT_WEIGHT_PATH | serves with | any other method: serve stops at config time; the line's first fix |",
        "| --- | --- | --- |",
    ]
    for kind in KINDS:
        serving = [m for m in METHODS if expected(kind.name, m) == SERVES]
        fixes: dict[str, list[str]] = {}
        for method in METHODS:
            fix = EXPECTED[kind.name].get(method, EXPECTED[kind.name]["*"])
            if fix != SERVES:
                fixes.setdefault(fix, []).append(method)
        default = EXPECTED[kind.name]["*"]
        parts = [f"{', '.join(methods)}: {fix}" for fix, methods in fixes.items() if fix != default]
        if default in fixes:
            others = "the others" if parts or serving else "all"
            that = default.replace("{method}", "that method's")
            parts.append(f"{others}: {that}")
        rows.append(f"| {kind.text} | {', '.join(serving) or 'none'} | {'; '.join(parts)} |")
    served = [
        f"- {BY_NAME[kind].text}, `{method}`: `{test}` ({what})" for (kind, method), (test, what) in SERVED_BY.items()
    ]
    return "\n".join([*rows, "", "Where a pair serves, the end-to-end test that shows it:", "", *served]) + "\n"
