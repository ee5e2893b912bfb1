"""KT_CONFIG presets: the shipped ones load and match their derivation, the environment
wins over them, and a broken preset is one line naming the file, key, value and what is
allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kt_plugin.planning.gpu_budget import DEFAULT_GPU_MEMORY_UTILIZATION, fit_gpu_experts
from vllm_kt_plugin.settings.catalogue import GIB
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.loader import load_settings
from vllm_kt_plugin.settings.presets import apply_preset, find_preset, load_preset, preset_files
from vllm_kt_plugin.settings.variables import KTSettings

REQUIRED = ["deepseek-v3", "deepseek-r1", "kimi-k2", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "glm-4.5-air"]


def from_env(env: dict[str, str]) -> KTSettings:
    return load_settings(env, cores=16, numa_nodes=1)


@pytest.mark.parametrize("name", REQUIRED)
def test_required_presets_exist(name: str) -> None:
    assert find_preset(name).is_file()


def test_deepseek_r1_is_the_deepseek_v3_preset() -> None:
    assert find_preset("deepseek-r1") == find_preset("deepseek-v3")


@pytest.mark.parametrize("path", preset_files(), ids=lambda p: p.stem)
def test_gpu_table_follows_from_the_model_shapes(path: Path) -> None:
    """The table in each file is what the budget formula gives for its model_config: a
    hand edit of one number, or a change of the formula, fails here."""
    preset = load_preset(path, cores=16, numa_nodes=1)
    assert preset.memory is not None and set(preset.experts_by_gpu_gb) == {24, 48, 80, 141}
    expected = {
        gb: fit_gpu_experts(
            device_total_bytes=gb * GIB, gpu_memory_utilization=DEFAULT_GPU_MEMORY_UTILIZATION, memory=preset.memory
        ).num_gpu_experts
        for gb in preset.experts_by_gpu_gb
    }
    assert dict(preset.experts_by_gpu_gb) == expected


@pytest.mark.parametrize("path", preset_files(), ids=lambda p: p.stem)
def test_preset_recommends_a_method_it_documents(path: Path) -> None:
    preset = load_preset(path, cores=16, numa_nodes=1)
    assert preset.settings["KT_METHOD"] in preset.methods
    assert all("KT_WEIGHT_PATH" in text or "GGUF" in text for text in preset.methods.values())


def test_model_sizes_match_the_published_parameter_counts() -> None:
    """DeepSeek-V3 has 671B parameters (MTP layer excluded), ~654B of them routed experts."""
    memory = load_preset(find_preset("deepseek-v3"), cores=16, numa_nodes=1).memory
    assert memory is not None
    experts = memory.expert_params * memory.num_experts * memory.num_moe_layers
    assert 650e9 < experts < 660e9
    assert memory.num_moe_layers == 58 and memory.num_experts == 256


def test_preset_sets_method_and_gpu_experts_for_the_gpu_size() -> None:
    kt = from_env({"KT_CONFIG": "deepseek-v3", "KT_GPU_MEMORY_GB": "80"})
    assert (kt.method, kt.num_gpu_experts) == ("AMXINT4", 16)
    assert kt.preset == str(find_preset("deepseek-v3"))


def test_environment_overrides_the_preset() -> None:
    kt = from_env({"KT_CONFIG": "deepseek-v3", "KT_GPU_MEMORY_GB": "80", "KT_METHOD": "fp8", "KT_NUM_GPU_EXPERTS": "3"})
    assert (kt.method, kt.num_gpu_experts) == ("FP8", 3)


def test_ratio_in_the_environment_replaces_the_table() -> None:
    kt = from_env({"KT_CONFIG": "qwen3-30b-a3b", "KT_GPU_MEMORY_GB": "24", "KT_GPU_EXPERTS_RATIO": "0.5"})
    assert (kt.num_gpu_experts, kt.gpu_experts_ratio) == (0, 0.5)


@pytest.mark.parametrize("gpu_gb,expected", [(79.1, 16), (140.4, 35), (47.0, 7), (30.0, 0), (10.0, 0), (200.0, 35)])
def test_gpu_size_picks_the_largest_entry_not_above_it(gpu_gb: float, expected: int) -> None:
    merged, _ = apply_preset({"KT_CONFIG": "deepseek-v3"}, cores=16, numa_nodes=1, detect_gpu_gb=lambda: gpu_gb)
    assert merged["KT_NUM_GPU_EXPERTS"] == str(expected)


def test_without_a_known_gpu_size_the_table_is_not_used() -> None:
    merged, _ = apply_preset({"KT_CONFIG": "deepseek-v3"}, cores=16, numa_nodes=1, detect_gpu_gb=lambda: None)
    assert "KT_NUM_GPU_EXPERTS" not in merged and merged["KT_METHOD"] == "AMXINT4"


def test_preset_given_as_a_path(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nsettings:\n  KT_METHOD: BF16\n  KT_NUM_GPU_EXPERTS: 2\n")
    kt = from_env({"KT_CONFIG": str(path)})
    assert (kt.method, kt.num_gpu_experts, kt.preset) == ("BF16", 2, str(path.resolve()))


@pytest.mark.parametrize("value", ["no-such-model", "/no/such/preset.yaml"])
def test_unknown_preset(value: str) -> None:
    with pytest.raises(KTConfigError) as exc:
        from_env({"KT_CONFIG": value})
    message = str(exc.value)
    assert "\n" not in message and f"KT_CONFIG={value!r}" in message and "allowed" in message


def test_unknown_preset_name_lists_the_presets() -> None:
    with pytest.raises(KTConfigError, match="deepseek-v3"):
        from_env({"KT_CONFIG": "deepseek-v4"})


MODEL_CONFIG = (
    "model_config: {hidden_size: 64, moe_intermediate_size: 32, num_hidden_layers: 2, "
    "num_experts: 8, num_attention_heads: 4, vocab_size: 100}\n"
)
BROKEN = [
    # (id, preset text, key named, value named)
    ("bad gpu expert count", "settings: {KT_NUM_GPU_EXPERTS: lots}\n", "KT_NUM_GPU_EXPERTS", "lots"),
    ("bad thread count", "settings: {KT_CPUINFER: 0}\n", "KT_CPUINFER", "0"),
    ("bad placement", "settings: {KT_EXPERT_PLACEMENT: everywhere}\n", "KT_EXPERT_PLACEMENT", "everywhere"),
    ("unknown variable", "settings: {KT_NUM_GPU_EXPERT: 4}\n", "settings.KT_NUM_GPU_EXPERT", "4"),
    ("preset inside a preset", "settings: {KT_CONFIG: other}\n", "settings.KT_CONFIG", "other"),
    ("list value", "settings: {KT_METHOD: [BF16, FP8]}\n", "settings.KT_METHOD", "['BF16', 'FP8']"),
    ("unknown method", "methods: {INT3: text}\n", "methods.INT3", "INT3"),
    (
        "method not documented",
        "settings: {KT_METHOD: FP8}\nmethods: {AMXINT4: KT_WEIGHT_PATH = converted}\n",
        "settings.KT_METHOD",
        "FP8",
    ),
    ("too many gpu experts", MODEL_CONFIG + "gpu_experts: {80: 9}\n", "gpu_experts.80", "9"),
    ("negative gpu experts", "gpu_experts: {80: -1}\n", "gpu_experts.80", "-1"),
    ("gpu size not a number", "gpu_experts: {big: 3}\n", "gpu_experts.big", "big"),
    ("misspelled key", "setings: {KT_METHOD: BF16}\n", "setings", "KT_METHOD"),
    ("model config without hidden size", "model_config: {num_experts: 8}\n", "model_config", "hidden_size"),
    ("not yaml", "settings: [unclosed\n", "<file>", "line"),
    ("not a mapping", "- a\n- b\n", "<file>", "list"),
]


@pytest.mark.parametrize("text,key,value", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_broken_preset_is_one_clear_line(tmp_path: Path, text: str, key: str, value: str) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(KTConfigError) as exc:
        from_env({"KT_CONFIG": str(path)})
    message = str(exc.value)
    assert "\n" not in message, message
    assert f"KT_CONFIG preset {path}" in message, message
    assert key in message and value in message and "allowed" in message, message


def test_a_ratio_in_the_environment_replaces_a_presets_count(tmp_path) -> None:
    """The environment wins: a preset's KT_NUM_GPU_EXPERTS gives way to KT_GPU_EXPERTS_RATIO
    (and the reverse) instead of clashing with it."""
    preset = tmp_path / "mine.yaml"
    preset.write_text("name: mine\nsettings:\n  KT_NUM_GPU_EXPERTS: 4\n")
    kt = from_env({"KT_CONFIG": str(preset), "KT_GPU_EXPERTS_RATIO": "0.25"})
    assert (kt.num_gpu_experts, kt.gpu_experts_ratio) == (0, 0.25)
    preset.write_text("name: mine\nsettings:\n  KT_GPU_EXPERTS_RATIO: 0.5\n")
    kt = from_env({"KT_CONFIG": str(preset), "KT_NUM_GPU_EXPERTS": "3"})
    assert (kt.num_gpu_experts, kt.gpu_experts_ratio) == (3, None)
