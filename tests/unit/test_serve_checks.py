"""doctor's checks are serve's checks: every refusal of the config tests goes through vLLM's
own config-time path (``EngineArgs.create_engine_config``, what ``vllm serve`` runs in its
API-server process before the engine core starts) and through ``vllm-kt doctor --model``,
and both name the same variable with the same line."""

from __future__ import annotations

import re

import pytest
from test_settings import MISTAKES

from vllm_kt_plugin.cpu_backends.base import ERROR, WARN
from vllm_kt_plugin.cpu_backends.kt_kernel import backend as ktb
from vllm_kt_plugin.hybrid import serve_checks
from vllm_kt_plugin.hybrid.serve_checks import config_error_in
from vllm_kt_plugin.settings.catalogue import KNOWN_VARIABLES
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_tools.cli.doctor import read_system, run_checks

# Refusals that need the model (the tiny Qwen3-MoE: 8 experts, top-2, hidden 128, experts 64 wide).
MODEL_MISTAKES = [
    ("more GPU experts than the model has", {"KT_NUM_GPU_EXPERTS": "16"}, "KT_NUM_GPU_EXPERTS", "16"),
    ("AMXINT4 on 64-wide experts", {"KT_METHOD": "AMXINT4"}, "KT_METHOD", "AMXINT4"),
    ("auto without a GPU", {"KT_NUM_GPU_EXPERTS": "auto"}, "KT_NUM_GPU_EXPERTS", "auto"),
    ("deferring every expert", {"KT_MAX_DEFERRED_EXPERTS_PER_TOKEN": "2"}, "KT_MAX_DEFERRED_EXPERTS_PER_TOKEN", "2"),
]
# The other refusals of test_settings.py and hybrid/staging/test_plan.py that need no file, NUMA
# layout or checkpoint of their own (those are checked by the same code: serve_checks.validated
# and the backend's check_model).
MORE_MISTAKES = [
    ("negative staging threshold", {"KT_STAGING_MIN_TOKENS": "-1"}, "KT_STAGING_MIN_TOKENS", "-1"),
    ("staging threshold not a number", {"KT_STAGING_MIN_TOKENS": "many"}, "KT_STAGING_MIN_TOKENS", "many"),
    ("staging threshold not a number, old name", {"KT_GPU_PREFILL_MIN_TOKENS": "x"}, "KT_STAGING_MIN_TOKENS", "x"),
    ("negative dynamic experts", {"KT_DYNAMIC_GPU_EXPERTS": "-1"}, "KT_DYNAMIC_GPU_EXPERTS", "-1"),
    (
        "dynamic experts beside a fixed staging threshold",
        {"KT_DYNAMIC_GPU_EXPERTS": "1", "KT_STAGING_MIN_TOKENS": "2048"},
        "KT_DYNAMIC_GPU_EXPERTS",
        "1",
    ),
    (
        "dynamic experts on AMXINT8",
        {"KT_DYNAMIC_GPU_EXPERTS": "1", "KT_METHOD": "AMXINT8"},
        "KT_DYNAMIC_GPU_EXPERTS",
        "1",
    ),
    ("dynamic experts on torch", {"KT_DYNAMIC_GPU_EXPERTS": "1", "KT_BACKEND": "torch"}, "KT_DYNAMIC_GPU_EXPERTS", "1"),
    ("cache dir under a file", {"KT_CACHE_DIR": "/proc/cpuinfo/cache"}, "KT_CACHE_DIR", "/proc/cpuinfo/cache"),
    (
        "FP8 copy with staging off",
        {"KT_STAGING_FP8_COPY": "1", "KT_STAGING_MIN_TOKENS": "0"},
        "KT_STAGING_FP8_COPY",
        "1",
    ),
]
CASES = [*MISTAKES, *MODEL_MISTAKES, *MORE_MISTAKES]


@pytest.fixture
def no_gpu_with_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same machine for both paths whatever runs the tests: vLLM's platform without a
    GPU, and a kt-kernel build with AMX kernels (so AMXINT4 is refused for its sizes)."""
    monkeypatch.setattr(serve_checks, "platform_has_gpu", lambda: False)
    monkeypatch.setattr(ktb, "kernel_available", lambda method: True)


def serve_refusal(model: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> KTConfigError | None:
    """What vLLM's front end does with ``vllm serve MODEL --quantization kt-hybrid``."""
    from vllm.engine.arg_utils import EngineArgs

    for name in KNOWN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        EngineArgs(model=model, quantization="kt-hybrid", max_model_len=512).create_engine_config()
    except Exception as e:
        error = config_error_in(e)
        assert error is not None, f"serve failed, but not with a KTConfigError: {e!r}"
        return error
    return None


@pytest.mark.parametrize("env,variable,value", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_doctor_refuses_what_serve_refuses(
    tiny_model, no_gpu_with_amx: None, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], variable: str, value: str
) -> None:
    model = str(tiny_model("qwen3_moe"))
    served = serve_refusal(model, env, monkeypatch)
    assert served is not None and (served.variable, str(served.value)) == (variable, value), served
    errors = [d for d in run_checks(env, read_system(), model) if d.level == ERROR and d.check in ("settings", "serve")]
    assert errors and str(served) in errors[0].reason, (str(served), errors)
    # The "allowed" text never lists the value it refuses (AMXINT4 on 64-wide experts once
    # did: "allowed: a kt-kernel inference method (AMXINT4, AMXINT8, ...)").
    listed = {item.strip() for item in re.split(r"[,;:()]|\bor\b", served.allowed)}
    assert value not in listed, served


def test_a_preset_for_another_model_warns_in_both(
    tiny_model, no_gpu_with_amx: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = str(tiny_model("qwen3_moe"))
    env = {"KT_CONFIG": "qwen3-30b-a3b"}
    with caplog.at_level("WARNING", logger="vllm_kt_plugin"):
        assert serve_refusal(model, env, monkeypatch) is None
    served = [r.getMessage() for r in caplog.records if "is a preset for another model" in r.getMessage()]
    assert served, caplog.text
    warned = [d for d in run_checks(env, read_system(), model) if d.check == "serve"]
    assert [d.level for d in warned] == [WARN] and warned[0].reason in served[0], (warned, served)


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
BLOCK_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# (checkpoint's quantization_config, KT_METHOD, a GPU here, what serve says of KT_STAGING_MIN_TOKENS=64)
STAGING = [
    (None, "AMXINT4", False, None),  # unquantized: staged from a host copy, on any device
    (GPTQ, "AMXINT4", True, "this checkpoint's experts are quantized"),
    (BLOCK_FP8, "FP8", True, None),  # kt-kernel's FP8 writes them back, under CUDA
    (BLOCK_FP8, "FP8", False, "a CUDA device, not cpu"),
    (BLOCK_FP8, "AMXINT4", True, "KT_METHOD=FP8"),
]


@pytest.mark.parametrize(("quant", "method", "has_gpu", "refusal"), STAGING)
def test_a_fixed_staging_threshold_is_refused_where_nothing_can_be_staged(
    quant: dict | None, method: str, has_gpu: bool, refusal: str | None
) -> None:
    """Refused at config time (serve's API-server process, doctor), by the rule each layer
    applies again on the kernel vLLM chose: the staging plan); auto and 0 are never refused here."""
    from vllm_kt_plugin.settings.variables import KTSettings
    from vllm_kt_tools.bench.shapes import SHAPES

    config = {**SHAPES["qwen3-30b-a3b"], **({"quantization_config": quant} if quant else {})}
    experts = config["num_experts"]
    for threshold in ("auto", "0"):
        lenient = KTSettings.from_env({"KT_METHOD": method, "KT_STAGING_MIN_TOKENS": threshold}, cores=4, numa_nodes=1)
        serve_checks.check_staging(lenient, config, experts, has_gpu=has_gpu)
    fixed = KTSettings.from_env({"KT_METHOD": method, "KT_STAGING_MIN_TOKENS": "64"}, cores=4, numa_nodes=1)
    if refusal is None:
        serve_checks.check_staging(fixed, config, experts, has_gpu=has_gpu)
        return
    with pytest.raises(KTConfigError) as refused:
        serve_checks.check_staging(fixed, config, experts, has_gpu=has_gpu)
    assert (refused.value.variable, refused.value.value) == ("KT_STAGING_MIN_TOKENS", "64")
    assert refusal in str(refused.value), refused.value
    all_on_gpu = KTSettings.from_env(
        {"KT_METHOD": method, "KT_STAGING_MIN_TOKENS": "64", "KT_NUM_GPU_EXPERTS": str(experts)},
        cores=4,
        numa_nodes=1,
    )
    serve_checks.check_staging(all_on_gpu, config, experts, has_gpu=has_gpu)  # no CPU experts to stage


def test_fp8_copy_is_refused_at_config_time_on_a_quantized_checkpoint() -> None:
    """Decided from the settings and the checkpoint's format alone (the staging plan with
    those facts), so serve's config-time checks (and doctor, which runs them) refuse it
    before any weight loads."""
    from vllm_kt_plugin.cpu_backends.base import CheckpointFormat
    from vllm_kt_plugin.hybrid.serve_checks import validated
    from vllm_kt_plugin.settings.variables import KTSettings

    env = {"KT_BACKEND": "torch", "KT_STAGING_FP8_COPY": "1"}
    settings = KTSettings.from_env(env, cores=4, numa_nodes=1)
    assert settings.staging_fp8_copy
    validated(settings, CheckpointFormat())  # a BF16 checkpoint: accepted
    env = {"KT_BACKEND": "kt_kernel", "KT_METHOD": "FP8", "KT_STAGING_FP8_COPY": "1"}
    settings = KTSettings.from_env(env, cores=4, numa_nodes=1)
    fp8 = CheckpointFormat("fp8", {"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(KTConfigError) as refused:
        validated(settings, fp8)
    assert (refused.value.variable, str(refused.value.value)) == ("KT_STAGING_FP8_COPY", "1")
    assert "already quantized (fp8)" in str(refused.value)
