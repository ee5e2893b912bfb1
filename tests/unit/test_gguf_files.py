"""KT_METHOD=LLAMAFILE's GGUF experts, checked at config time from the files' headers: a
file, a llama.cpp split set or a folder is accepted; a missing layer or expert, a shape that
disagrees with the checkpoint's config, a GGML type the llamafile kernels do not compute,
and an expert width that is not a multiple of 256 are each one KTConfigError line naming
the file, the tensor and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kt_plugin.cpu_backends.base import CheckpointFormat
from vllm_kt_plugin.cpu_backends.kt_kernel.backend import KTKernelExperts, check_alignment
from vllm_kt_plugin.cpu_backends.kt_kernel.gguf_files import check_gguf, gguf_files, kt_kernel_path
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.loader import load_settings
from vllm_kt_tools.support.gguf_export import write_random_experts

H, INTER, E = 256, 256, 4
LAYERS = [1, 2]  # layer 0 is dense, as in DeepSeek-V3
HF_CONFIG = {
    "model_type": "qwen3_moe",
    "hidden_size": H,
    "moe_intermediate_size": INTER,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "mlp_only_layers": [0],
    "decoder_sparse_step": 1,
    "num_experts": E,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "vocab_size": 32,
    "torch_dtype": "bfloat16",
}


def gguf(path: Path, layers: list[int] = LAYERS, experts: int = E, inter: int = INTER, types: object = "Q8_0") -> Path:
    return write_random_experts(path, layers, experts, H, inter, types)  # type: ignore[arg-type]


def check(path: Path, variant: str = "amx") -> list[Path]:
    return check_gguf(str(path), LAYERS, E, H, INTER, variant)


def refusal(path: Path, variant: str = "amx") -> str:
    with pytest.raises(KTConfigError) as caught:
        check(path, variant)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("KT_WEIGHT_PATH="), message
    return message


def test_a_file_a_folder_and_a_split_set_are_accepted(tmp_path: Path) -> None:
    single = gguf(tmp_path / "one" / "model-Q8_0.gguf")
    assert check(single) == [single]
    assert check(single.parent) == [single]
    parts = [tmp_path / "split" / f"model-{i:05d}-of-00002.gguf" for i in (1, 2)]
    gguf(parts[0], layers=[1])
    gguf(parts[1], layers=[2])
    assert check(parts[0]) == parts  # the first file names the whole set
    assert check(parts[0].parent) == parts


def test_q4_k_m_mixes_types(tmp_path: Path) -> None:
    """llama.cpp's Q4_K_M: Q4_K gate/up with Q6_K down projections (K-quant rows are
    256-wide blocks, so hidden 256 here)."""
    types = {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}
    path = write_random_experts(tmp_path / "m.gguf", LAYERS, E, 256, INTER, types)
    assert check_gguf(str(path), LAYERS, E, 256, INTER, "avx2") == [path]


def test_a_missing_layer_names_the_file_and_tensor(tmp_path: Path) -> None:
    message = refusal(gguf(tmp_path / "m.gguf", layers=[1]))
    assert "m.gguf: no blk.2.ffn_gate_exps.weight" in message and "1..2" in message


def test_missing_experts_name_the_tensor_and_count(tmp_path: Path) -> None:
    message = refusal(gguf(tmp_path / "m.gguf", experts=E - 1))
    assert (
        f"m.gguf: blk.1.ffn_gate_exps.weight is Q8_0 [{E - 1}, {INTER}, {H}], expected [{E}, {INTER}, {H}]" in message
    )
    assert f"({E} experts)" in message


def test_a_shape_that_disagrees_with_the_config(tmp_path: Path) -> None:
    message = refusal(gguf(tmp_path / "m.gguf", inter=2 * INTER))
    assert f"blk.1.ffn_gate_exps.weight is Q8_0 [{E}, {2 * INTER}, {H}], expected [{E}, {INTER}, {H}]" in message
    assert f"hidden_size {H} and moe_intermediate_size {INTER}" in message


@pytest.mark.parametrize(("type_name", "variant"), [("Q4_1", "amx"), ("Q5_1", "avx2"), ("BF16", "avx2")])
def test_a_type_the_kernels_do_not_compute_is_refused(tmp_path: Path, type_name: str, variant: str) -> None:
    message = refusal(gguf(tmp_path / "m.gguf", types=type_name), variant)
    assert f"blk.1.ffn_gate_exps.weight is {type_name}, which kt-kernel's LLAMAFILE ({variant} build)" in message
    assert "expected one of F32, F16, Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K" in message


def test_bf16_experts_are_accepted_where_the_kernels_compute_them(tmp_path: Path) -> None:
    path = gguf(tmp_path / "m.gguf", types="BF16")
    assert check(path, "avx512_bf16") == [path]
    refusal(path, "avx512_base")  # NaN there: measured (gguf_files.LLAMAFILE_TYPES)


def test_two_models_in_one_folder_are_refused(tmp_path: Path) -> None:
    gguf(tmp_path / "model-Q8_0.gguf")
    gguf(tmp_path / "model-Q4_0.gguf", types="Q4_0")
    message = refusal(tmp_path)
    assert "blk.1.ffn_gate_exps.weight is in both model-Q4_0.gguf and model-Q8_0.gguf" in message


def test_a_split_set_missing_a_file_is_refused(tmp_path: Path) -> None:
    first = gguf(tmp_path / "model-00001-of-00003.gguf", layers=[1])
    gguf(tmp_path / "model-00002-of-00003.gguf", layers=[2])
    assert "model-00003-of-00003.gguf is missing: the split set has 3 files" in refusal(first)


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    path = gguf(tmp_path / "m.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert "m.gguf cannot be read as GGUF" in refusal(path)


def test_a_folder_without_gguf_names_its_subfolders(tmp_path: Path) -> None:
    gguf(tmp_path / "Q4_K_M" / "m.gguf")
    assert "its subfolders Q4_K_M do" in refusal(tmp_path)


@pytest.mark.parametrize(
    ("hidden", "width", "named"), [(256, 64, "moe_intermediate_size 64"), (384, 256, "hidden_size 384")]
)
def test_the_sizes_must_be_multiples_of_256(hidden: int, width: int, named: str) -> None:
    with pytest.raises(KTConfigError) as caught:
        check_alignment("LLAMAFILE", hidden, width)
    assert str(caught.value).startswith("KT_METHOD='LLAMAFILE' is invalid (kt-kernel's LLAMAFILE needs a hidden")
    assert f"multiples of 256; this model has {named})" in str(caught.value)
    check_alignment("LLAMAFILE", 512, 768)
    with pytest.raises(KTConfigError, match="KT_THREADPOOL_COUNT='2'"):
        check_alignment("LLAMAFILE", 256, 256, pools=2)


def test_kt_kernel_gets_exactly_the_models_files(tmp_path: Path) -> None:
    """A split set beside other GGUF files goes to kt-kernel as a folder of links to the set
    (kt-kernel reads every .gguf of a folder); a lone file or a folder as they are."""
    parts = [gguf(tmp_path / f"model-{i:05d}-of-00002.gguf", layers=[i]) for i in (1, 2)]
    assert kt_kernel_path(str(parts[0]), parts, str(tmp_path / "cache")) == str(tmp_path)
    other = gguf(tmp_path / "other-Q4_0.gguf", types="Q4_0")
    links = Path(kt_kernel_path(str(parts[0]), gguf_files(str(parts[0])), str(tmp_path / "cache")))
    assert sorted(p.name for p in links.iterdir()) == [p.name for p in parts]
    assert all((links / p.name).resolve() == p.resolve() for p in parts)
    assert kt_kernel_path(str(other), [other], str(tmp_path / "cache")) == str(other)


def settings_for(env: dict[str, str]):  # noqa: ANN201 - KTSettings
    return load_settings(env, cores=4, numa_nodes=1)


def test_weight_path_takes_a_gguf_file_and_implies_llamafile(tmp_path: Path) -> None:
    path = gguf(tmp_path / "m.gguf")
    settings = KTKernelExperts.resolve_method(settings_for({"KT_WEIGHT_PATH": str(path)}), CheckpointFormat())
    assert settings.weight_path == str(path) and settings.method == "LLAMAFILE"
    KTKernelExperts.validate(settings, CheckpointFormat())
    KTKernelExperts.check_model(settings, str(tmp_path), HF_CONFIG)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(KTConfigError, match="not a directory"):
        settings_for({"KT_WEIGHT_PATH": str(tmp_path / "notes.txt")})


def test_a_gguf_file_is_refused_for_other_methods(tmp_path: Path) -> None:
    path = gguf(tmp_path / "m.gguf")
    settings = settings_for({"KT_WEIGHT_PATH": str(path), "KT_METHOD": "BF16"})
    with pytest.raises(
        KTConfigError, match=r"a GGUF file; KT_METHOD=BF16 reads .*allowed: KT_METHOD=LLAMAFILE for these"
    ):
        KTKernelExperts.validate(settings, CheckpointFormat())


def test_llamafile_without_weights_says_what_to_point_at() -> None:
    settings = settings_for({"KT_METHOD": "LLAMAFILE"})
    with pytest.raises(KTConfigError, match=r"KT_WEIGHT_PATH is unset .*allowed: a \.gguf file of this model"):
        KTKernelExperts.validate(settings, CheckpointFormat())


def test_the_serve_check_refuses_a_mismatched_gguf(tmp_path: Path) -> None:
    """What `vllm serve` runs at config time (``check_model``) reads the GGUF headers."""
    path = gguf(tmp_path / "m.gguf", layers=[1])
    settings = settings_for({"KT_WEIGHT_PATH": str(path), "KT_METHOD": "LLAMAFILE"})
    with pytest.raises(KTConfigError, match="no blk.2.ffn_gate_exps.weight"):
        KTKernelExperts.check_model(settings, str(tmp_path), HF_CONFIG)
