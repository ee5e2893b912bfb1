"""KT_WEIGHT_PATH against KT_METHOD: every kind of path (``support.weight_matrix.KINDS``: the
model's own checkpoint, kt-kernel's and KTransformers' converted layouts, GGUF, and the
mistakes) crossed with every method, through serve's config-time checks (``check_serving``,
what vLLM's front end runs before any weight loads) and through ``vllm-kt doctor``: each pair
serves, or stops with one line, the same in both, whose first fix is the matrix's.

The folder verdict does not depend on this CPU's kernels (their check comes first, and is
faked present here), so the matrix is the same on every machine; the AMX layer folders are
kt-kernel's own where this CPU has the kernel, else written with its names and sizes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from kt_testing.hardware import requires_kernel

from vllm_kt_plugin.cpu_backends.base import ERROR, OK
from vllm_kt_plugin.cpu_backends.kt_kernel import backend as ktb
from vllm_kt_plugin.cpu_backends.kt_kernel.methods import kernel_available, kt_inference_methods
from vllm_kt_plugin.cpu_backends.kt_kernel.weight_paths import (
    Checkpoint,
    check_layers,
    classify,
    decide,
    part_bytes,
)
from vllm_kt_plugin.hybrid import serve_checks
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.model_memory import ExpertShape, num_routed_experts
from vllm_kt_tools.cli.doctor import read_system, run_checks
from vllm_kt_tools.support import weight_matrix
from vllm_kt_tools.support.kt_weight_layouts import convert_layers, fake_layers, quantize_layers
from vllm_kt_tools.support.weight_matrix import SERVES, build, expected, write_models

ROOT = Path(__file__).resolve().parents[2]
CASES = weight_matrix.cases()


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> tuple[weight_matrix.Models, dict[str, str | None], Path]:
    root = tmp_path_factory.mktemp("weight-paths")
    models = write_models(root)
    real = frozenset(m for m in ("AMXINT4", "AMXINT8") if _has_kernel(m))
    return models, build(root / "paths", models, quantize=real), root


def _has_kernel(method: str) -> bool:
    kt_inference_methods()
    return kernel_available(method)


@pytest.fixture
def every_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder verdict alone: every method's kernel present, vLLM's platform without a GPU."""
    monkeypatch.setattr(ktb, "kernel_available", lambda method: True)
    monkeypatch.setattr(serve_checks, "platform_has_gpu", lambda: False)


def case_env(matrix: tuple, kind: str, method: str) -> tuple[str, dict[str, str]]:
    models, paths, root = matrix
    model = models.fp8 if weight_matrix.BY_NAME[kind].checkpoint == "fp8" else models.bf16
    env = {"KT_METHOD": method, "KT_CACHE_DIR": str(root / "cache")}
    if paths[kind] is not None:
        env["KT_WEIGHT_PATH"] = str(paths[kind])
    return str(model), env


def serve_refusal(model: str, env: dict[str, str]) -> KTConfigError | None:
    try:
        serve_checks.check_serving(env, model, cores=4, numa_nodes=1, has_gpu=False)
    except KTConfigError as e:
        return e
    return None


@pytest.mark.parametrize(("kind", "method"), CASES, ids=[f"{k}-{m}" for k, m in CASES])
def test_serve_and_doctor_agree_on_every_path_and_method(matrix, every_kernel: None, kind: str, method: str) -> None:
    model, env = case_env(matrix, kind, method)
    refusal = serve_refusal(model, env)
    want = expected(kind, method)
    weights = [d for d in run_checks(env, read_system(), model) if d.check == "weights"]
    if want == SERVES:
        assert refusal is None, str(refusal)
        assert [d.level for d in weights] == [OK], weights
        return
    assert refusal is not None, f"{kind} with {method} passed serve's checks"
    line = str(refusal)
    assert "\n" not in line and refusal.variable in ("KT_WEIGHT_PATH", "KT_METHOD"), line
    assert refusal.allowed.startswith(want), line
    assert [(d.level, d.reason) for d in weights] == [(ERROR, line)], (line, weights)


def test_the_matrix_names_tests_that_exist() -> None:
    for (kind, method), (test, _) in weight_matrix.SERVED_BY.items():
        assert expected(kind, method) == SERVES, (kind, method)
        path, name = test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), test
    serving = {case for case in CASES if expected(*case) == SERVES}
    assert serving == set(weight_matrix.SERVED_BY), serving ^ set(weight_matrix.SERVED_BY)


def test_the_original_report_is_one_line_naming_the_fix(matrix, every_kernel: None) -> None:
    """AMXINT8 with the model's own BF16 folder (issue 48): kt-kernel's ``No experts found
    for key blk.0`` in a worker once; now the line names the folder, the method and the fix."""
    model, env = case_env(matrix, "hf-bf16", "AMXINT8")
    refusal = serve_refusal(model, env)
    assert refusal is not None
    assert str(refusal) == weight_matrix.REPORTED.format(path=model)


@pytest.mark.parametrize("method", ["MOE_INT4", "MOE_INT8"])
def test_methods_no_x86_build_carries_are_refused_before_any_path(matrix, method: str) -> None:
    """kt-kernel 0.7.2 lists MOE_INT4/MOE_INT8, but its x86 wheels build neither kernel: once
    refused in a worker after the weights loaded, now by the kernel check, whatever the path."""
    model, env = case_env(matrix, "kt-quant-amxint8", method)
    refusal = serve_refusal(model, env)
    assert refusal is not None and (refusal.variable, refusal.value) == ("KT_METHOD", method), refusal
    assert f"no {method} kernel" in str(refusal)


# --- the classification: names and headers only -------------------------------------------


def write_header_only(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file whose header declares ``tensors`` and whose data is absent: what
    the classification reads of a file (a real one would be this header plus the data)."""
    offset, header = 0, {}
    for name, (dtype, shape) in tensors.items():
        size = (1 if dtype in ("I8", "U8", "F8_E4M3") else 2 if dtype in ("BF16", "F16") else 4) * int(
            torch.tensor(shape).prod()
        )
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_a_600_gb_checkpoint_is_classified_from_its_headers(tmp_path: Path) -> None:
    """163 shards declaring DeepSeek-V3's 256 experts of 58 layers (FP8: 7168 x 2048 each)
    and holding none of their bytes: nothing but the headers is read."""
    for shard in range(163):
        tensors = {}
        for layer in range(3 + shard * 58 // 163, 3 + (shard + 1) * 58 // 163):
            for expert in range(256):
                base = f"model.layers.{layer}.mlp.experts.{expert}.gate_proj"
                tensors[f"{base}.weight"] = ("F8_E4M3", [2048, 7168])
                tensors[f"{base}.weight_scale_inv"] = ("F32", [16, 56])
        write_header_only(tmp_path / f"model-{shard + 1:05d}-of-00163.safetensors", tensors)
    held = classify(str(tmp_path))
    assert held.hf_format == "block-FP8" and held.readers == {"FP8"} and held.safetensors == 163


@pytest.mark.parametrize(
    ("suffixes", "fmt", "readers"),
    [
        ({"weight": ("BF16", [8, 4])}, "BF16", {"BF16"}),
        ({"weight": ("F16", [8, 4])}, "FP16", set()),
        ({"weight": ("F8_E4M3", [8, 4]), "weight_scale_inv": ("F32", [1, 1])}, "block-FP8", {"FP8"}),
        (
            {"weight": ("F8_E4M3", [8, 4]), "weight_scale": ("F32", [8, 1])},
            "per-channel FP8",
            {"FP8", "FP8_PERCHANNEL"},
        ),
        ({"weight": ("F8_E4M3", [8, 4]), "weight_scale_inv": ("U8", [8, 1])}, "MXFP8", {"MXFP8"}),
        ({"qweight": ("I32", [1, 8]), "scales": ("F16", [1, 8])}, "GPTQ-INT4", {"GPTQ_INT4", "SYCL_GPTQ_INT4"}),
        ({"weight_packed": ("I32", [8, 1]), "weight_scale": ("BF16", [8, 1])}, "compressed-tensors-INT4", {"RAWINT4"}),
        (
            {"weight": ("U8", [8, 2]), "weight_scale": ("F8_E4M3", [8, 1]), "weight_scale_2": ("F32", [])},
            "NVFP4",
            {"NVFP4"},
        ),
    ],
)
def test_the_checkpoint_format_is_read_from_the_first_experts_tensors(
    tmp_path: Path, suffixes: dict, fmt: str, readers: set
) -> None:
    tensors = {
        f"model.layers.1.mlp.experts.{e}.{p}.{s}": v
        for e in range(2)
        for p in ("gate_proj", "up_proj", "down_proj")
        for s, v in suffixes.items()
    }
    write_header_only(tmp_path / "model.safetensors", tensors)
    held = classify(str(tmp_path))
    assert (held.hf_format, held.readers) == (fmt, readers)


def test_mxfp4_experts_in_deepseek_v4s_layout(tmp_path: Path) -> None:
    tensors = {
        f"layers.3.ffn.experts.0.{p}.{s}": ("I8", [8, 2]) for p in ("w1", "w2", "w3") for s in ("weight", "scale")
    }
    write_header_only(tmp_path / "model.safetensors", tensors)
    assert classify(str(tmp_path)).readers == {"MXFP4"}


def test_weights_one_folder_down_are_named(tmp_path: Path) -> None:
    """The cache's model folder instead of its method folder, or a folder of conversions: the
    line names the subfolder that holds them."""
    fake = tmp_path / "cache" / "model-0123" / "AMXINT8-pools1" / "_layer_0" / "_numa_0"
    fake.mkdir(parents=True)
    (fake / "INT8_up_0_8Byte_quant_.kt").write_bytes(b"x" * 8)
    refusal = decide("AMXINT8", classify(str(tmp_path / "cache" / "model-0123")), pools=1)
    assert refusal is not None and "its subfolder AMXINT8-pools1 holds weights" in str(refusal), refusal


def test_converted_files_in_a_subfolder_are_refused_for_amx(tmp_path: Path) -> None:
    """kt-kernel's AMX wrapper reads converted safetensors only when some lie directly in the
    folder (else it looks for _layer_N folders)."""
    model = tiny_model_dir(tmp_path)
    converted = convert_layers(fake_layers(model, tmp_path / "layers", "AMXINT8"), model, tmp_path / "out", "AMXINT8")
    (converted / "sub").mkdir()
    for shard in converted.glob("*.safetensors"):
        shard.rename(converted / "sub" / shard.name)
    held = classify(str(converted))
    assert held.readers == {"AMXINT8", "MOE_INT8"}
    refusal = decide("AMXINT8", held, pools=1)
    assert refusal is not None and "in subfolders" in str(refusal), refusal


SHAPE = ExpertShape(moe_layers=(0, 1), num_experts=4, hidden_size=128, intermediate_size=256)


def tiny_model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    config = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 4, "hidden_size": 128}
    (model / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 256}))
    return model


@pytest.mark.parametrize("method", ["AMXINT4", "AMXINT8"])
@pytest.mark.parametrize("pools", [1, 2])
def test_layer_folders_are_checked_file_by_file(tmp_path: Path, method: str, pools: int) -> None:
    layers = fake_layers(tiny_model_dir(tmp_path), tmp_path / "layers", method, pools)
    assert check_layers(method, classify(str(layers)), SHAPE, pools) is None
    victim = next(layers.glob(f"_layer_1/_numa_{pools - 1}/*_down_3_*Byte_scale_.kt"))
    victim.write_bytes(victim.read_bytes()[:-4])
    refusal = check_layers(method, classify(str(layers)), SHAPE, pools)
    assert refusal is not None and "cut short" in str(refusal) and victim.name in str(refusal)
    victim.unlink()
    refusal = check_layers(method, classify(str(layers)), SHAPE, pools)
    assert refusal is not None and f"layer 1 NUMA part {pools - 1}: no down scale of expert 3" in str(refusal)


def test_converted_experts_of_another_model_are_refused(tmp_path: Path) -> None:
    """Bytes per expert follow the hidden size and the expert width: another model's
    conversion (here experts half as wide) is refused by size."""
    model = tiny_model_dir(tmp_path)
    layers = fake_layers(model, tmp_path / "layers", "AMXINT8")
    converted = convert_layers(layers, model, tmp_path / "out", "AMXINT8")
    narrower = ExpertShape(SHAPE.moe_layers, SHAPE.num_experts, SHAPE.hidden_size, SHAPE.intermediate_size * 2)
    refusal = check_layers("AMXINT8", classify(str(converted)), narrower, 1)
    want = part_bytes("AMXINT8", 128, 512, 1)[("gate", "weight")]
    assert refusal is not None and f"have {want}: converted from another model?" in str(refusal), refusal


@pytest.mark.parametrize("fmt", ["INT4", "INT8"])
def test_bits_are_read_from_the_sizes(tmp_path: Path, fmt: str) -> None:
    model = tiny_model_dir(tmp_path)
    method = f"AMX{fmt}"
    converted = convert_layers(fake_layers(model, tmp_path / "layers", method, 2), model, tmp_path / "out", method, 2)
    held = classify(str(converted))
    assert held.converted is not None and held.converted.pools == 2 and method in held.readers
    assert decide(method, held, pools=2) is None
    assert "KT_THREADPOOL_COUNT=2" in str(decide(method, held, pools=1))


def test_the_advice_follows_the_checkpoint(tmp_path: Path) -> None:
    """An empty folder with AMXINT8: unset (quantize online) only where the checkpoint is
    unquantized; a block-FP8 checkpoint needs converted weights."""
    held = classify(str(tmp_path))
    online = decide("AMXINT8", held, pools=1, checkpoint=Checkpoint(None, "BF16"))
    assert online is not None and online.allowed.startswith("KT_WEIGHT_PATH unset, to quantize")
    converted = decide("AMXINT8", held, pools=1, checkpoint=Checkpoint("fp8", "FP8"))
    assert converted is not None and converted.allowed.startswith("a folder of AMXINT8 experts")


# --- the layouts the fixtures write are kt-kernel's -----------------------------------------


@requires_kernel("AMXINT8")
@pytest.mark.parametrize("method", ["AMXINT4", "AMXINT8"])
def test_the_fake_layer_folders_are_kt_kernels_names_and_sizes(matrix, method: str) -> None:
    """Where this CPU has the kernel, kt-kernel's own files name what ``fake_layers`` writes
    elsewhere: same names, same sizes."""
    if not _has_kernel(method):
        pytest.skip(f"no {method} kernel in this CPU's kt-kernel build")
    models, _, root = matrix
    real = quantize_layers(models.bf16, root / "real-cache", method)
    fake = fake_layers(models.bf16, root / f"fake-{method}", method)

    def listing(folder: Path) -> list[tuple[str, int]]:
        return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*.kt"))

    assert listing(real) == listing(fake)


@requires_kernel("AMXINT8")
@pytest.mark.parametrize("method", ["AMXINT4", "AMXINT8"])
def test_kt_kernel_reads_the_converted_layout_as_its_own(matrix, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """kt-kernel's wrapper on the converted folder (its SafeTensorLoader) computes what it
    computes on the layer folders the same bytes came from."""
    if not _has_kernel(method):
        pytest.skip(f"no {method} kernel in this CPU's kt-kernel build")
    from vllm_kt_plugin.cpu_backends.kt_kernel.compat import prepare_kt_kernel

    kt_kernel = prepare_kt_kernel()
    from kt_kernel.utils.amx import AMXMoEWrapper

    # kt-kernel keeps the first converted folder's reader for the whole process (one model
    # per process): each case here reads its own
    monkeypatch.setattr(AMXMoEWrapper, "_safetensor_loader_instance", None)
    models, _, root = matrix
    layers = quantize_layers(models.bf16, root / "read-cache", method)
    converted = convert_layers(layers, models.bf16, root / "read-converted", method)
    config = json.loads((models.bf16 / "config.json").read_text())
    # transformers 5.19 writes qwen3_moe's expert count as num_local_experts: read it as the plugin does
    experts, hidden, width = num_routed_experts(config), config["hidden_size"], config["moe_intermediate_size"]
    torch.manual_seed(0)
    x = torch.randn(4, hidden, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(experts)[:2] for _ in range(4)])
    weights = torch.rand(4, 2)
    outputs = []
    for folder in (layers, converted):
        wrapper = kt_kernel.KTMoEWrapper(
            layer_idx=1,
            num_experts=experts,
            num_experts_per_tok=2,
            hidden_size=hidden,
            moe_intermediate_size=width,
            gpu_experts_mask=torch.zeros(experts, dtype=torch.bool),
            cpuinfer_threads=1,
            threadpool_count=1,
            weight_path=str(folder),
            # kt-kernel's AMX buffers take it in multiples of their M step: 16 stopped the wrapper
            # ("max_m and k must be multiple of M_STEP and K_STEP", 2-core AVX-512 box)
            chunked_prefill_size=64,
            method=method,
        )
        physical_to_logical = torch.arange(experts)
        wrapper.load_weights(physical_to_logical)
        wrapper.submit_forward(x, ids, weights, 0)
        outputs.append(wrapper.sync_forward(x, 0).clone())
    assert outputs[0].abs().sum() > 0 and torch.equal(outputs[0], outputs[1])
