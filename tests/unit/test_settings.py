"""KT_* validation: every mistake is one line naming the variable, the value and what is
allowed; raised while the quant config is built, before any weight exists."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from vllm_kt_plugin.cpu_backends.base import CheckpointFormat
from vllm_kt_plugin.cpu_backends.kt_kernel import backend as ktb
from vllm_kt_plugin.cpu_backends.registry import backend_class
from vllm_kt_plugin.settings.catalogue import AUTO, LOGGER_NAME, RENAMED, VARIABLES
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.loader import load_settings
from vllm_kt_plugin.settings.variables import KTSettings, default_cpuinfer_threads

UNQUANTIZED = CheckpointFormat()
FP8_BLOCK = CheckpointFormat("fp8", {"quant_method": "fp8", "weight_block_size": [128, 128]})


def build(env: dict[str, str], checkpoint: CheckpointFormat = UNQUANTIZED, *, cores: int = 16, numa: int = 1):
    """What KTHybridConfig does at config time: parse, pick the backend, validate."""
    from vllm_kt_plugin.hybrid.serve_checks import validated

    return validated(load_settings(env, cores=cores, numa_nodes=numa), checkpoint)


def assert_one_line_error(exc: pytest.ExceptionInfo, variable: str, value: str) -> None:
    message = str(exc.value)
    assert "\n" not in message
    assert variable in message, message
    assert value in message, message
    assert "allowed" in message, message


@pytest.fixture
def no_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kt-kernel build without AMXINT4/AMXINT8 kernels (a CPU without AVX-512)."""
    monkeypatch.setattr(ktb, "kernel_available", lambda method: method not in ktb.QUANTIZES_ONLINE)


@pytest.fixture
def with_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ktb, "kernel_available", lambda method: True)


@pytest.fixture
def weights_dir(tmp_path: Path) -> Path:
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "model.safetensors").write_bytes(b"")
    return tmp_path / "w"


MISTAKES = [
    # (id, env, variable named, value named)
    ("unknown backend", {"KT_BACKEND": "nope"}, "KT_BACKEND", "nope"),
    ("unknown method", {"KT_METHOD": "INT3"}, "KT_METHOD", "INT3"),
    ("unknown vllm cores", {"KT_VLLM_CORES": "pinned"}, "KT_VLLM_CORES", "pinned"),
    ("negative gpu experts", {"KT_NUM_GPU_EXPERTS": "-1"}, "KT_NUM_GPU_EXPERTS", "-1"),
    ("non-integer gpu experts", {"KT_NUM_GPU_EXPERTS": "half"}, "KT_NUM_GPU_EXPERTS", "half"),
    ("split share of one", {"KT_STAGING_SPLIT": "1"}, "KT_STAGING_SPLIT", "1"),
    ("fp8 copy not a flag", {"KT_STAGING_FP8_COPY": "2"}, "KT_STAGING_FP8_COPY", "2"),
    ("gather window in seconds", {"KT_STAGING_GATHER_MS": "30000"}, "KT_STAGING_GATHER_MS", "30000"),
    (
        "gather with staging off",
        {"KT_STAGING_GATHER_MS": "30", "KT_STAGING_MIN_TOKENS": "0"},
        "KT_STAGING_GATHER_MS",
        "30",
    ),
    (
        "gather by its former name with staging off",
        {"KT_GPU_PREFILL_GATHER_MS": "30", "KT_STAGING_MIN_TOKENS": "0"},
        "KT_STAGING_GATHER_MS",
        "30",
    ),
    ("zero threads", {"KT_CPUINFER": "0"}, "KT_CPUINFER", "0"),
    ("non-integer threads", {"KT_CPUINFER": "1.5"}, "KT_CPUINFER", "1.5"),
    ("more pools than NUMA nodes", {"KT_THREADPOOL_COUNT": "2"}, "KT_THREADPOOL_COUNT", "2"),
    ("zero pools", {"KT_THREADPOOL_COUNT": "0"}, "KT_THREADPOOL_COUNT", "0"),
    ("missing weight path", {"KT_WEIGHT_PATH": "/no/such/dir"}, "KT_WEIGHT_PATH", "/no/such/dir"),
    ("zero chunk", {"KT_CHUNKED_PREFILL_SIZE": "0"}, "KT_CHUNKED_PREFILL_SIZE", "0"),
    ("non-integer chunk", {"KT_CHUNKED_PREFILL_SIZE": "4k"}, "KT_CHUNKED_PREFILL_SIZE", "4k"),
    ("negative deferral", {"KT_MAX_DEFERRED_EXPERTS_PER_TOKEN": "-2"}, "KT_MAX_DEFERRED_EXPERTS_PER_TOKEN", "-2"),
    ("negative metrics interval", {"KT_METRICS_INTERVAL": "-1"}, "KT_METRICS_INTERVAL", "-1"),
    ("non-numeric metrics interval", {"KT_METRICS_INTERVAL": "often"}, "KT_METRICS_INTERVAL", "often"),
    ("torch backend with AMX method", {"KT_BACKEND": "torch", "KT_METHOD": "AMXINT4"}, "KT_METHOD", "AMXINT4"),
    (
        "torch backend with deferral",
        {"KT_BACKEND": "torch", "KT_MAX_DEFERRED_EXPERTS_PER_TOKEN": "1"},
        "KT_MAX_DEFERRED_EXPERTS_PER_TOKEN",
        "1",
    ),
    ("FP8 method on a BF16 checkpoint", {"KT_METHOD": "FP8"}, "KT_METHOD", "FP8"),
]


@pytest.mark.parametrize("env,variable,value", [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_mistake_is_one_clear_line(env: dict[str, str], variable: str, value: str) -> None:
    with pytest.raises(KTConfigError) as exc:
        build(env)
    assert_one_line_error(exc, variable, value)


def test_weight_path_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(KTConfigError) as exc:
        build({"KT_WEIGHT_PATH": str(f)})
    assert_one_line_error(exc, "KT_WEIGHT_PATH", str(f))
    assert "not a directory" in str(exc.value)


def test_weight_path_without_weights(tmp_path: Path) -> None:
    with pytest.raises(KTConfigError) as exc:
        build({"KT_WEIGHT_PATH": str(tmp_path)})
    assert_one_line_error(exc, "KT_WEIGHT_PATH", str(tmp_path))
    assert "*.safetensors" in str(exc.value)


def test_amx_method_on_cpu_without_amx(no_amx: None, weights_dir: Path) -> None:
    with pytest.raises(KTConfigError) as exc:
        build({"KT_METHOD": "AMXINT4", "KT_WEIGHT_PATH": str(weights_dir)})
    assert_one_line_error(exc, "KT_METHOD", "AMXINT4")
    assert "no AMXINT4 kernel" in str(exc.value)


def test_amx_method_without_weight_path_quantizes_online(with_amx: None, tmp_path: Path) -> None:
    cache = tmp_path / "new" / "cache"
    kt, _ = build({"KT_METHOD": "AMXINT8", "KT_CACHE_DIR": str(cache)})
    assert (kt.method, kt.weight_path, kt.cache_dir) == ("AMXINT8", None, str(cache.resolve()))
    assert cache.is_dir()


def test_online_quantization_needs_an_unquantized_checkpoint(with_amx: None, tmp_path: Path) -> None:
    with pytest.raises(KTConfigError) as exc:
        build({"KT_METHOD": "AMXINT4", "KT_CACHE_DIR": str(tmp_path)}, FP8_BLOCK)
    assert_one_line_error(exc, "KT_METHOD", "AMXINT4")
    assert "fp8" in str(exc.value) and "KT_WEIGHT_PATH" in str(exc.value)


def test_cache_dir_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(KTConfigError) as exc:
        build({"KT_CACHE_DIR": str(blocker / "cache")})
    assert_one_line_error(exc, "KT_CACHE_DIR", str(blocker / "cache"))
    assert "cannot create" in str(exc.value)


def test_amx_method_accepted_where_amx_exists(with_amx: None, tmp_path: Path) -> None:
    quantized = tmp_path / "w" / "_layer_0" / "_numa_0"  # kt-kernel's own AMXINT8 files (weight_paths.py)
    quantized.mkdir(parents=True)
    (quantized / "INT8_up_0_64Byte_quant_.kt").write_bytes(b"x" * 64)
    kt, backend = build({"KT_METHOD": "amxint8", "KT_WEIGHT_PATH": str(tmp_path / "w")})
    assert (kt.method, backend.name, kt.weight_path) == ("AMXINT8", "kt_kernel", str((tmp_path / "w").resolve()))


def test_torch_backend_refuses_quantized_checkpoint() -> None:
    with pytest.raises(KTConfigError) as exc:
        build({"KT_BACKEND": "torch"}, FP8_BLOCK)
    assert "KT_BACKEND=torch" in str(exc.value) and "fp8" in str(exc.value)


def test_too_many_gpu_experts_for_the_model() -> None:
    kt, _ = build({"KT_NUM_GPU_EXPERTS": "9"})
    with pytest.raises(KTConfigError) as exc:
        kt.check_model(num_experts=8, top_k=2)
    assert_one_line_error(exc, "KT_NUM_GPU_EXPERTS", "9")
    assert "8 routed experts" in str(exc.value)


def test_deferring_every_expert_is_refused() -> None:
    kt, _ = build({"KT_MAX_DEFERRED_EXPERTS_PER_TOKEN": "2"})
    with pytest.raises(KTConfigError) as exc:
        kt.check_model(num_experts=8, top_k=2)
    assert_one_line_error(exc, "KT_MAX_DEFERRED_EXPERTS_PER_TOKEN", "2")


def test_chunk_smaller_than_the_batch_budget() -> None:
    kt, _ = build({"KT_CHUNKED_PREFILL_SIZE": "256"})
    with pytest.raises(KTConfigError) as exc:
        kt.resolve_chunked_prefill_size(max_num_batched_tokens=2048)
    assert_one_line_error(exc, "KT_CHUNKED_PREFILL_SIZE", "256")
    assert "2048" in str(exc.value)


def test_model_without_experts() -> None:
    kt, _ = build({})
    with pytest.raises(KTConfigError, match="Mixture-of-Experts"):
        kt.check_model(num_experts=0, top_k=0)


def test_pools_need_threads() -> None:
    with pytest.raises(KTConfigError) as exc:
        build({"KT_THREADPOOL_COUNT": "3", "KT_CPUINFER": "2"}, numa=4)
    assert_one_line_error(exc, "KT_THREADPOOL_COUNT", "3")


def test_defaults() -> None:
    kt, backend = build({}, cores=16)
    assert backend.name == "kt_kernel"
    assert (kt.method, kt.num_gpu_experts, kt.cpuinfer_threads, kt.threadpool_count) == ("BF16", 0, 14, 1)
    assert kt.weight_path is None and kt.max_deferred_experts_per_token == 0
    assert kt.resolve_chunked_prefill_size(2048) == 2048


def test_default_threads_leave_two_cores() -> None:
    assert [default_cpuinfer_threads(c) for c in (1, 2, 3, 16, 64)] == [1, 1, 1, 14, 62]


def test_default_method_follows_the_checkpoint() -> None:
    kt_cls = backend_class("kt_kernel")
    gptq = CheckpointFormat("auto_gptq", {"quant_method": "gptq", "bits": 4, "sym": True})  # vLLM 0.32's name
    ct_int4 = CheckpointFormat("compressed-tensors", {"config_groups": {"g": {"weights": {"num_bits": 4}}}})
    ct_fp8_channel = CheckpointFormat(
        "compressed-tensors",
        {"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
    )
    assert [kt_cls.default_method(c) for c in (UNQUANTIZED, FP8_BLOCK, gptq, ct_int4, ct_fp8_channel)] == [
        "BF16",
        "FP8",
        "GPTQ_INT4",
        "RAWINT4",
        "FP8_PERCHANNEL",
    ]


@pytest.mark.parametrize(
    "checkpoint",
    [
        CheckpointFormat("fp8", {"quant_method": "fp8"}),  # per-tensor scales: no kt-kernel reader
        CheckpointFormat("gptq_marlin", {"quant_method": "gptq", "bits": 4, "desc_act": True}),
        CheckpointFormat("awq_marlin", {"quant_method": "awq", "bits": 4}),
    ],
    ids=["fp8 per-tensor", "gptq act-order", "awq"],
)
def test_checkpoints_without_a_default_method_ask_for_one(checkpoint: CheckpointFormat) -> None:
    with pytest.raises(KTConfigError, match="KT_METHOD is unset"):
        build({}, checkpoint)


@pytest.fixture
def warnings_seen(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Our logger lives under vLLM's, which does not propagate to the root logger that
    caplog listens on: attach caplog's handler to it directly."""
    plugin_logger = logging.getLogger(LOGGER_NAME)
    plugin_logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    yield caplog
    plugin_logger.removeHandler(caplog.handler)


def test_all_threads_warns(warnings_seen: pytest.LogCaptureFixture) -> None:
    build({"KT_CPUINFER": "16"}, cores=16)
    assert "KT_CPUINFER=16 uses all 16 usable cores" in warnings_seen.text


def test_typo_in_variable_name_warns(warnings_seen: pytest.LogCaptureFixture) -> None:
    build({"KT_NUM_GPU_EXPERT": "4", "KT_KERNEL_DEBUG": "1"})
    assert "KT_NUM_GPU_EXPERT" in warnings_seen.text and "did you mean KT_NUM_GPU_EXPERTS" in warnings_seen.text
    assert "KT_KERNEL_DEBUG" not in warnings_seen.text  # kt-kernel's own variable


def test_every_variable_is_documented_in_the_readme() -> None:
    """The README's Configuration table has one row per variable the code knows, and none
    it does not."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = re.findall(r"^\| `(KT_[A-Z0-9_]+)` \|", readme, flags=re.MULTILINE)
    assert sorted(rows) == sorted(variable.name for variable in VARIABLES)


def test_the_readme_opens_with_the_demo_and_the_tests() -> None:
    """A newcomer's first screen: exactly two commands, the demo and the tests."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    assert readme.index("```bash") < readme.index("## Requirements")


@pytest.mark.parametrize("raw", ["-1", "many", "1.5"])
def test_staging_min_tokens_is_validated(raw: str) -> None:
    with pytest.raises(KTConfigError, match=f"KT_STAGING_MIN_TOKENS='{re.escape(raw)}'"):
        KTSettings.from_env({"KT_STAGING_MIN_TOKENS": raw}, cores=4, numa_nodes=1)


def test_staging_is_auto_unless_set() -> None:
    """AUTO is auto (decided per model, host and layer by the staging plan)."""
    assert KTSettings.from_env({}, cores=4, numa_nodes=1).staging_min_tokens is AUTO
    assert KTSettings.from_env({"KT_STAGING_MIN_TOKENS": " Auto"}, cores=4, numa_nodes=1).staging_min_tokens is AUTO
    assert KTSettings.from_env({"KT_STAGING_MIN_TOKENS": "0"}, cores=4, numa_nodes=1).staging_min_tokens == 0
    assert KTSettings.from_env({"KT_STAGING_MIN_TOKENS": "64"}, cores=4, numa_nodes=1).staging_min_tokens == 64


def test_every_auto_is_one_value_parsed_by_the_catalogue() -> None:
    """``auto`` is AUTO in every field it can set, straight from the catalogue's parser
    (nothing converts it afterwards), and each such field is AUTO by default where auto is
    the default."""
    every = {
        "KT_METHOD": "method",
        "KT_NUM_GPU_EXPERTS": "num_gpu_experts",
        "KT_STAGING_MIN_TOKENS": "staging_min_tokens",
        "KT_STAGING_SPLIT": "staging_split",
        "KT_STAGING_FP8_COPY": "staging_fp8_copy",
    }
    parsed = KTSettings.from_env(dict.fromkeys(every, "auto"), cores=4, numa_nodes=1)
    assert all(getattr(parsed, field) is AUTO for field in every.values())
    by_name = {v.name: v for v in VARIABLES}
    assert all(by_name[name].parse("AUTO") is AUTO for name in every)
    assert parsed.gpu_experts_auto and not KTSettings.from_env({}, cores=4, numa_nodes=1).gpu_experts_auto
    defaults = KTSettings.from_env({}, cores=4, numa_nodes=1)
    assert [f for f in every.values() if getattr(defaults, f) is AUTO] == [
        "staging_min_tokens",
        "staging_split",
        "staging_fp8_copy",
    ]


def test_auto_survives_the_trip_to_vllms_workers() -> None:
    """vLLM pickles the quant config, settings included, into each worker process: AUTO comes
    back as the catalogue's own AUTO (a copy of it would read as a set value there)."""
    import copy
    import pickle

    parsed = KTSettings.from_env({"KT_NUM_GPU_EXPERTS": "auto", "KT_STAGING_MIN_TOKENS": "16"}, cores=4, numa_nodes=1)
    there = pickle.loads(pickle.dumps(parsed))
    assert there == parsed and there.num_gpu_experts is AUTO and there.staging_split is AUTO
    assert there.staging_fp8_copy is AUTO and there.gpu_experts_auto
    assert copy.deepcopy(AUTO) is AUTO and copy.copy(AUTO) is AUTO


def test_a_former_name_still_works_and_names_the_new_one(warnings_seen: pytest.LogCaptureFixture) -> None:
    """KT_GPU_PREFILL_* became KT_STAGING_*: the old names are read (one notice each, naming
    the new name), not warned about as unknown; both set to different values is refused."""
    from vllm_kt_plugin.settings import variables

    assert RENAMED == {
        "KT_GPU_PREFILL_MIN_TOKENS": "KT_STAGING_MIN_TOKENS",
        "KT_GPU_PREFILL_SPLIT": "KT_STAGING_SPLIT",
        "KT_GPU_PREFILL_FP8_COPY": "KT_STAGING_FP8_COPY",
        "KT_GPU_PREFILL_GATHER_MS": "KT_STAGING_GATHER_MS",
    }
    variables._NOTICED.clear()
    old = {
        "KT_GPU_PREFILL_MIN_TOKENS": "64",
        "KT_GPU_PREFILL_SPLIT": "0.5",
        "KT_GPU_PREFILL_FP8_COPY": "0",
        "KT_GPU_PREFILL_GATHER_MS": "10",
    }
    parsed = load_settings(old, cores=4, numa_nodes=1)
    notices = [r.getMessage() for r in warnings_seen.records]
    load_settings(old, cores=4, numa_nodes=1)
    assert len(warnings_seen.records) == len(notices)  # once per process
    assert (parsed.staging_min_tokens, parsed.staging_split, parsed.staging_fp8_copy) == (64, 0.5, False)
    assert parsed.staging_gather_ms == 10
    assert list(dict.fromkeys(notices)) == [
        f"kt-hybrid: {name} is now called {new}; the old name still works" for name, new in RENAMED.items()
    ], notices
    same = {"KT_GPU_PREFILL_MIN_TOKENS": "64", "KT_STAGING_MIN_TOKENS": "64"}
    assert KTSettings.from_env(same, cores=4, numa_nodes=1).staging_min_tokens == 64
    with pytest.raises(KTConfigError, match="its former name KT_GPU_PREFILL_MIN_TOKENS is set too") as exc:
        KTSettings.from_env({**same, "KT_STAGING_MIN_TOKENS": "128"}, cores=4, numa_nodes=1)
    assert_one_line_error(exc, "KT_STAGING_MIN_TOKENS", "128")


def test_gather_window_is_30_ms_unless_set() -> None:
    """KT_STAGING_GATHER_MS (kt-hybrid's scheduler): 30 by default, 0 turns it off, and the
    default stays quiet with staging off (only a value given is refused there)."""

    def window(env: dict[str, str]) -> float:
        return KTSettings.from_env(env, cores=4, numa_nodes=1).staging_gather_ms

    assert window({}) == 30.0 and window({"KT_STAGING_GATHER_MS": "0"}) == 0
    off = {"KT_STAGING_MIN_TOKENS": "0"}
    assert window(off) == 30.0 and window({**off, "KT_STAGING_GATHER_MS": "0"}) == 0


def test_dynamic_gpu_experts_are_validated(with_amx: None) -> None:
    """KT_DYNAMIC_GPU_EXPERTS: an integer >= 0; it needs CPU experts that can be written
    back to the GPU (BF16 on kt-kernel) and leaves no room for staging set to a number."""
    assert build({"KT_DYNAMIC_GPU_EXPERTS": "4", "KT_METHOD": "BF16"})[0].dynamic_gpu_experts == 4
    assert build({})[0].dynamic_gpu_experts == 0
    with pytest.raises(KTConfigError) as exc:
        build({"KT_DYNAMIC_GPU_EXPERTS": "-1"})
    assert_one_line_error(exc, "KT_DYNAMIC_GPU_EXPERTS", "-1")
    with pytest.raises(KTConfigError, match="KT_STAGING_MIN_TOKENS=2048 is set too") as exc:
        build({"KT_DYNAMIC_GPU_EXPERTS": "1", "KT_STAGING_MIN_TOKENS": "2048"})
    assert_one_line_error(exc, "KT_DYNAMIC_GPU_EXPERTS", "1")
    with pytest.raises(KTConfigError, match="kt_kernel AMXINT8 CPU experts cannot move to the GPU") as exc:
        build({"KT_DYNAMIC_GPU_EXPERTS": "1", "KT_METHOD": "AMXINT8"})
    assert_one_line_error(exc, "KT_DYNAMIC_GPU_EXPERTS", "1")
    with pytest.raises(KTConfigError, match="torch BF16 CPU experts cannot move"):
        build({"KT_DYNAMIC_GPU_EXPERTS": "1", "KT_BACKEND": "torch"})


def test_a_kernel_known_to_crash_is_refused_like_a_missing_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """kt-kernel 0.7.2's AVX2 RAWINT4 kernel segfaults in its first forward (every shape we
    tried): on that variant a compressed-tensors INT4 checkpoint stops at config time."""
    kt_kernel = pytest.importorskip("kt_kernel")

    monkeypatch.setattr(kt_kernel, "__cpu_variant__", "avx2")
    ct_int4 = CheckpointFormat("compressed-tensors", {"config_groups": {"g": {"weights": {"num_bits": 4}}}})
    with pytest.raises(KTConfigError, match="AVX2 RAWINT4 kernel crashes the process") as exc:
        build({}, ct_int4)
    assert_one_line_error(exc, "KT_METHOD", "RAWINT4")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KT_STAGING_SPLIT": "0"}, "KT_STAGING_SPLIT='0'"),
        ({"KT_STAGING_SPLIT": "1"}, "strictly between 0 and 1"),
        ({"KT_STAGING_SPLIT": "half"}, "not a number"),
        ({"KT_STAGING_FP8_COPY": "2"}, "must be auto, 0 or 1"),
    ],
)
def test_split_settings_are_checked_at_config_time(env: dict[str, str], message: str) -> None:
    with pytest.raises(KTConfigError, match=message):
        KTSettings.from_env(env, cores=4, numa_nodes=1)


def test_split_settings_parse() -> None:
    default = KTSettings.from_env({}, cores=4, numa_nodes=1)
    assert default.staging_split is AUTO and default.staging_fp8_copy is AUTO  # auto, per layer
    given = KTSettings.from_env({"KT_STAGING_SPLIT": "0.25", "KT_STAGING_FP8_COPY": "1"}, cores=4, numa_nodes=1)
    assert given.staging_split == 0.25 and given.staging_fp8_copy
    assert KTSettings.from_env({"KT_STAGING_SPLIT": "auto"}, cores=4, numa_nodes=1).staging_split is AUTO
    assert KTSettings.from_env({"KT_STAGING_FP8_COPY": "0"}, cores=4, numa_nodes=1).staging_fp8_copy is False
    assert KTSettings.from_env({"KT_STAGING_FP8_COPY": "AUTO"}, cores=4, numa_nodes=1).staging_fp8_copy is AUTO
