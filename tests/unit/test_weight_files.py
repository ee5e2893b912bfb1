"""What kt-kernel will read is checked before it reads it: every expert present, of the
model's shapes, every file readable; and KT_CACHE_DIR has room for online weights. Each
mistake is one KTConfigError naming the layer, the expert and the file."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vllm_kt_plugin.cpu_backends.kt_kernel.backend import KTKernelExperts
from vllm_kt_plugin.cpu_backends.kt_kernel.weight_files import check_weight_files
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.loader import load_settings

H, INTER, E = 8, 4, 4
LAYERS = (1, 2)  # layer 0 is dense
DEEPSEEK = ("mlp.experts", ("gate_proj", "up_proj", "down_proj"))
MIXTRAL = ("block_sparse_moe.experts", ("w1", "w3", "w2"))
HF_CONFIG = {
    "model_type": "qwen3_moe",
    "hidden_size": H,
    "moe_intermediate_size": INTER,
    "intermediate_size": 16,
    "num_hidden_layers": 3,
    "mlp_only_layers": [0],
    "decoder_sparse_step": 1,
    "num_experts": E,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "vocab_size": 32,
    "torch_dtype": "bfloat16",
}


def expert_tensors(layout: tuple[str, tuple[str, ...]] = DEEPSEEK) -> dict[str, torch.Tensor]:
    experts, (gate, up, down) = layout
    tensors = {"model.embed_tokens.weight": torch.zeros(32, H, dtype=torch.bfloat16)}
    for layer in LAYERS:
        for e in range(E):
            base = f"model.layers.{layer}.{experts}.{e}"
            tensors[f"{base}.{gate}.weight"] = torch.zeros(INTER, H, dtype=torch.bfloat16)
            tensors[f"{base}.{up}.weight"] = torch.zeros(INTER, H, dtype=torch.bfloat16)
            tensors[f"{base}.{down}.weight"] = torch.zeros(H, INTER, dtype=torch.bfloat16)
    return tensors


def write(directory: Path, tensors: dict[str, torch.Tensor], name: str = "model-00001.safetensors") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / name, metadata={"format": "pt"})
    return directory


def check(directory: Path) -> None:
    check_weight_files("BF16", str(directory), LAYERS, E, H, INTER)


@pytest.mark.parametrize("layout", [DEEPSEEK, MIXTRAL], ids=["deepseek-qwen", "mixtral"])
def test_a_complete_checkpoint_passes(tmp_path: Path, layout) -> None:
    check(write(tmp_path, expert_tensors(layout)))


def test_experts_split_over_files_pass(tmp_path: Path) -> None:
    tensors = expert_tensors()
    first = {k: v for k, v in tensors.items() if ".layers.1." in k}
    write(tmp_path, first, "model-00001-of-00002.safetensors")
    write(tmp_path, {k: v for k, v in tensors.items() if k not in first}, "model-00002-of-00002.safetensors")
    check(tmp_path)


def test_wrong_shape_names_layer_expert_and_file(tmp_path: Path) -> None:
    tensors = expert_tensors()
    tensors["model.layers.2.mlp.experts.3.down_proj.weight"] = torch.zeros(H, INTER - 2, dtype=torch.bfloat16)
    with pytest.raises(KTConfigError) as exc:
        check(write(tmp_path, tensors))
    assert exc.value.variable == "KT_WEIGHT_PATH"
    assert "layer 2 expert 3: down_proj in model-00001.safetensors is BF16 [8, 2], expected BF16 [8, 4]" in str(
        exc.value
    )


def test_wrong_dtype_is_refused(tmp_path: Path) -> None:
    tensors = expert_tensors()
    tensors["model.layers.1.mlp.experts.0.gate_proj.weight"] = torch.zeros(INTER, H, dtype=torch.float16)
    with pytest.raises(KTConfigError, match="layer 1 expert 0: gate_proj in .* is F16"):
        check(write(tmp_path, tensors))


def test_missing_expert_names_it(tmp_path: Path) -> None:
    tensors = expert_tensors()
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    with pytest.raises(KTConfigError, match=r"layer 1 expert 2: no up_proj tensor \(model.layers.1.mlp.experts.2"):
        check(write(tmp_path, tensors))


def test_missing_layer_names_it(tmp_path: Path) -> None:
    tensors = {k: v for k, v in expert_tensors().items() if ".layers.2." not in k}
    with pytest.raises(KTConfigError, match="layer 2 expert 0: no gate_proj tensor"):
        check(write(tmp_path, tensors))


def test_truncated_file_names_it(tmp_path: Path) -> None:
    path = write(tmp_path, expert_tensors()) / "model-00001.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(KTConfigError, match="model-00001.safetensors cannot be read") as exc:
        check(tmp_path)
    assert "\n" not in str(exc.value)


def test_other_methods_check_that_files_open(tmp_path: Path) -> None:
    path = write(tmp_path, {"x": torch.zeros(2)}) / "model-00001.safetensors"
    check_weight_files("MXFP4", str(tmp_path), LAYERS, E, H, INTER)  # its tensors are not checked (yet)
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(KTConfigError, match="cannot be read"):
        check_weight_files("MXFP4", str(tmp_path), LAYERS, E, H, INTER)


QH, QI = 16, 8  # hidden and expert width of the quantized layouts below (INT4 packs 8 per int32)


def quantized_tensors(method: str) -> dict[str, torch.Tensor]:
    """Every expert of LAYERS in ``method``'s layout: FP8 with 128 x 128 block scales,
    compressed-tensors INT4 (groups of 8 here), GPTQ INT4 (one group)."""
    tensors = {}
    for layer in LAYERS:
        for e in range(E):
            for projection, (out, inn) in zip(DEEPSEEK[1], ((QI, QH), (QI, QH), (QH, QI)), strict=True):
                base = f"model.layers.{layer}.mlp.experts.{e}.{projection}"
                if method == "FP8":
                    tensors[f"{base}.weight"] = torch.zeros(out, inn, dtype=torch.float8_e4m3fn)
                    tensors[f"{base}.weight_scale_inv"] = torch.ones(1, 1)
                elif method == "RAWINT4":
                    tensors[f"{base}.weight_packed"] = torch.zeros(out, inn // 8, dtype=torch.int32)
                    tensors[f"{base}.weight_scale"] = torch.ones(out, inn // 8, dtype=torch.bfloat16)
                    tensors[f"{base}.weight_shape"] = torch.tensor([out, inn], dtype=torch.int32)
                else:
                    tensors[f"{base}.qweight"] = torch.zeros(inn // 8, out, dtype=torch.int32)
                    tensors[f"{base}.scales"] = torch.ones(1, out, dtype=torch.float16)
    return tensors


# method: (tensor to break, its replacement, what the error must say)
QUANTIZED_BREAKAGES = {
    "FP8": (
        "model.layers.2.mlp.experts.1.down_proj.weight_scale_inv",
        torch.ones(2, 2),
        "layer 2 expert 1: down_proj.weight_scale_inv in model-00001.safetensors is F32 [2, 2], expected F32/BF16 "
        "[1, 1] (or [16] per channel)",
    ),
    "RAWINT4": (
        "model.layers.1.mlp.experts.3.up_proj.weight_packed",
        torch.zeros(QI, 1, dtype=torch.int32),
        "layer 1 expert 3: up_proj in model-00001.safetensors is I32 [8, 1], expected I32 [8, 2]",
    ),
    "GPTQ_INT4": (
        "model.layers.1.mlp.experts.0.gate_proj.scales",
        torch.ones(3, QI, dtype=torch.float16),
        "layer 1 expert 0: gate_proj.scales in model-00001.safetensors is F16 [3, 8], expected F16/BF16/F32 "
        "[16/group, 8]",
    ),
}


@pytest.mark.parametrize("method", list(QUANTIZED_BREAKAGES))
def test_quantized_layouts_are_checked_tensor_by_tensor(tmp_path: Path, method: str) -> None:
    """What kt-kernel's FP8, RAWINT4 and GPTQ_INT4 readers take passes; a scale or packed
    weight of the wrong shape is one error naming the layer, expert, tensor and file."""
    tensors = quantized_tensors(method)
    check_weight_files(method, str(write(tmp_path / "ok", tensors)), LAYERS, E, QH, QI)
    name, replacement, message = QUANTIZED_BREAKAGES[method]
    tensors[name] = replacement
    with pytest.raises(KTConfigError) as exc:
        check_weight_files(method, str(write(tmp_path / "bad", tensors)), LAYERS, E, QH, QI)
    assert message in str(exc.value)


def test_a_missing_quantized_tensor_names_it(tmp_path: Path) -> None:
    tensors = quantized_tensors("GPTQ_INT4")
    del tensors["model.layers.2.mlp.experts.3.down_proj.scales"]
    with pytest.raises(KTConfigError, match=r"layer 2 expert 3: no down_proj.scales tensor \(model.layers.2"):
        check_weight_files("GPTQ_INT4", str(write(tmp_path, tensors)), LAYERS, E, QH, QI)


def test_packed_experts_pass_and_are_shape_checked(tmp_path: Path) -> None:
    tensors = {}
    for layer in LAYERS:
        tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.zeros(E, 2 * INTER, H, dtype=torch.bfloat16)
        tensors[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.zeros(E, H, INTER, dtype=torch.bfloat16)
    check(write(tmp_path / "ok", tensors))
    tensors["model.layers.2.mlp.experts.down_proj"] = torch.zeros(E - 1, H, INTER, dtype=torch.bfloat16)
    with pytest.raises(KTConfigError, match=r"layer 2: model.layers.2.mlp.experts.down_proj in .* \[3, 8, 4\]"):
        check(write(tmp_path / "bad", tensors))


def test_the_backend_runs_the_check_before_weights_load(tmp_path: Path) -> None:
    """KTKernelExperts.check_model, what `vllm serve` runs in its front end."""
    tensors = expert_tensors()
    tensors["model.layers.1.mlp.experts.1.down_proj.weight"] = torch.zeros(H, INTER + 1, dtype=torch.bfloat16)
    weights = write(tmp_path / "weights", tensors)
    settings = load_settings({"KT_METHOD": "BF16", "KT_WEIGHT_PATH": str(weights)}, cores=4, numa_nodes=1)
    with pytest.raises(KTConfigError, match="layer 1 expert 1: down_proj"):
        KTKernelExperts.check_model(settings, str(tmp_path / "model"), HF_CONFIG)
    good = write(tmp_path / "good", expert_tensors())
    settings = load_settings({"KT_METHOD": "BF16", "KT_WEIGHT_PATH": str(good)}, cores=4, numa_nodes=1)
    KTKernelExperts.check_model(settings, str(tmp_path / "model"), HF_CONFIG)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[callable]:
    """Mount small tmpfs file systems (read-only or nearly full) for the test's duration."""
    mounted: list[Path] = []

    def mount(name: str, options: str) -> Path:
        where = tmp_path / name
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}); needs root with CAP_SYS_ADMIN")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", str(where)], check=False)


def test_read_only_cache_dir_is_one_clear_error(tmpfs) -> None:
    read_only = tmpfs("ro", "ro,size=1m")
    with pytest.raises(KTConfigError) as exc:
        load_settings({"KT_CACHE_DIR": str(read_only)}, cores=4, numa_nodes=1)
    assert (exc.value.variable, exc.value.reason) == ("KT_CACHE_DIR", "not a writable directory")
    with pytest.raises(KTConfigError, match="KT_CACHE_DIR=.* is invalid \\(cannot create it"):
        load_settings({"KT_CACHE_DIR": str(read_only / "sub")}, cores=4, numa_nodes=1)


def test_full_cache_dir_is_refused_before_quantizing(tmpfs, tmp_path: Path) -> None:
    """Online AMXINT8 experts of a model whose layers do not fit: refused up front, with
    the room needed and the room free, instead of a disk filling up mid-load."""
    small = tmpfs("small", "size=64k")
    big = {**HF_CONFIG, "hidden_size": 256, "moe_intermediate_size": 128, "num_experts": 16}
    settings = load_settings({"KT_METHOD": "AMXINT8", "KT_CACHE_DIR": str(small)}, cores=4, numa_nodes=1)
    (tmp_path / "model").mkdir()
    with pytest.raises(KTConfigError) as exc:
        KTKernelExperts.check_model(settings, str(tmp_path / "model"), big)
    assert exc.value.variable == "KT_CACHE_DIR"
    assert "CPU experts of 2 uncached layers need" in exc.value.reason and "GB are free" in exc.value.reason
    roomy = load_settings({"KT_METHOD": "AMXINT8", "KT_CACHE_DIR": str(tmp_path / "c")}, cores=4, numa_nodes=1)
    KTKernelExperts.check_model(roomy, str(tmp_path / "model"), big)  # the same model fits on the test's disk
