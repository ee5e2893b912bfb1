"""``vllm-kt doctor``: each check's verdict on given machine contents, and the command on
this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_kt_plugin.cpu_backends.base import ERROR, OK, WARN
from vllm_kt_plugin.cpu_backends.kt_kernel import diagnostics
from vllm_kt_plugin.cpu_backends.kt_kernel.diagnostics import (
    KernelBuild,
    build_of,
    check_cpu,
    check_weights,
    fastest_here,
)
from vllm_kt_plugin.cpu_backends.kt_kernel.method_speeds import MethodSpeed
from vllm_kt_plugin.hybrid.staging.plan import host_copy_bytes
from vllm_kt_plugin.settings.catalogue import GIB, KT_METHODS
from vllm_kt_plugin.settings.model_memory import estimate_model_memory
from vllm_kt_tools.cli.doctor import (
    SystemInfo,
    check_numa,
    check_ram,
    check_threads,
    check_versions,
    cpu_flags_from_cpuinfo,
    doctor,
    mem_available_from_meminfo,
    run_checks,
)

ROOT = Path(__file__).resolve().parents[2]
REAL_LOADED_BUILD = diagnostics.loaded_build  # the autouse fixture below fakes it

SAPPHIRE_RAPIDS_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse sse2 avx avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
flags\t\t: fpu sse sse2 avx avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""
ZEN4_FLAGS = frozenset(["avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"])
MEMINFO = "MemTotal:       1056000000 kB\nMemFree:         9000000 kB\nMemAvailable:   1000000000 kB\n"
VERSIONS = {"kt-kernel": "0.7.2", "vllm": "0.32.0", "torch": "2.13.0"}
QWEN3_30B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_experts": 128,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "torch_dtype": "bfloat16",
}


def machine(**changes: object) -> SystemInfo:
    """A two-socket AMX host with 1 TB of RAM, unless told otherwise."""
    base = {
        "cpu_flags": cpu_flags_from_cpuinfo(SAPPHIRE_RAPIDS_CPUINFO),
        "usable_cores": 112,
        "numa_nodes": 2,
        "mem_available_bytes": mem_available_from_meminfo(MEMINFO),
        "versions": VERSIONS,
    }
    return SystemInfo(**{**base, **changes})  # type: ignore[arg-type]


def test_proc_readers() -> None:
    flags = cpu_flags_from_cpuinfo(SAPPHIRE_RAPIDS_CPUINFO)
    assert {"amx_tile", "amx_int8", "avx512_bf16"} <= flags and "flags" not in flags
    assert cpu_flags_from_cpuinfo("processor : 0\n") == frozenset()
    assert mem_available_from_meminfo(MEMINFO) == 1_000_000_000 * 1024
    assert mem_available_from_meminfo("MemTotal: 1 kB\n") is None


# What cannot run on each kt-kernel build, as kt-kernel 0.7.2's flags say (methods.kernel_available).
GPU_ONLY = {"SYCL_GPTQ_INT4": "an Intel GPU (SYCL) kernel, not a CPU one"}
CANNOT_RUN = {
    "amx": GPU_ONLY,
    "avx512_bf16": GPU_ONLY,
    "avx2": {
        **GPU_ONLY,
        **{m: "no kernel in kt-kernel's avx2 build" for m in ("AMXINT4", "AMXINT8", "FP8_PERCHANNEL")},
        "RAWINT4": "its AVX2 RAWINT4 kernel crashes the process",
    },
}


@pytest.fixture(autouse=True)
def kt_kernel_build(monkeypatch: pytest.MonkeyPatch):
    """``kt_kernel_build(variant)``: the build doctor sees kt-kernel load, with the shipped
    table's rows for it; the AMX one (``machine()``'s) unless a test picks another."""

    def use(variant: str | KernelBuild) -> KernelBuild:
        build = variant if isinstance(variant, KernelBuild) else build_of(variant, CANNOT_RUN[variant])
        monkeypatch.setattr(diagnostics, "loaded_build", lambda: build)
        return build

    use("amx")
    return use


# An EPYC Zen 4's build (AVX-512 with BF16, no AMX): a table where the AMX methods run on
# AVX-512, one within the noise of the fastest, one clearly slower.
ZEN4_BUILD = KernelBuild(
    "avx512_bf16",
    tuple(
        MethodSpeed(row, {"1": ms, "16": ms * 20})
        for row, ms in (("LLAMAFILE Q4_K", 2.9), ("AMXINT8", 3.7), ("AMXINT4", 7.3), ("BF16", 14.4))
    ),
    GPU_ONLY,
)


@pytest.mark.parametrize(
    "method,flags,level,words",
    [
        ("LLAMAFILE", ZEN4_FLAGS, OK, "LLAMAFILE: LLAMAFILE Q4_K: 2.90 ms a layer at batch 1, the fastest here"),
        # no AMX, yet AMXINT8 is measured close to the fastest: its verdict is the measurement's
        ("AMXINT8", ZEN4_FLAGS, OK, "1.3x the fastest's time, within the measurement's noise"),
        ("AMXINT4", ZEN4_FLAGS, WARN, "2.5x the fastest's time; the fastest: LLAMAFILE Q4_K, 2.90 ms"),
        ("FP8", ZEN4_FLAGS, OK, "KT_METHOD=FP8: runs here; not measured"),
        ("SYCL_GPTQ_INT4", ZEN4_FLAGS, ERROR, "cannot run here: an Intel GPU (SYCL) kernel"),
        (None, ZEN4_FLAGS, OK, "AVX-512-BF16 yes, AVX2 yes: kt-kernel loads its avx512_bf16 build"),
        ("BF16", frozenset({"sse2"}), ERROR, "no AVX2"),
    ],
)
def test_cpu_verdict_on_kt_method_is_the_measurements(
    kt_kernel_build, method: str | None, flags: frozenset[str], level: str, words: str
) -> None:
    kt_kernel_build(ZEN4_BUILD)
    verdict = check_cpu(method, flags)
    assert (verdict.level, words in verdict.reason) == (level, True), verdict
    assert "slow" not in verdict.reason  # the old flag rule ("AMX methods are slow without AMX") is gone


def methods_line(reason: str) -> dict[str, str]:
    """KT_METHOD -> its one verdict on the methods line: its measured row (LLAMAFILE: its
    fastest GGUF type's, listed first), or the list it is in."""
    verdicts: dict[str, str] = {}

    def give(method: str, verdict: str) -> None:
        assert method not in verdicts, f"{method} has two verdicts:\n{reason}"
        verdicts[method] = verdict

    for line in (line.strip() for line in reason.splitlines()[1:-1]):
        if line.startswith("runs here, not measured"):
            for method in line.split(": ", 1)[1].split(", "):
                give(method, "not measured")
        elif line.startswith("cannot run here: "):
            listed, why = line.removeprefix("cannot run here: ").split(": ", 1)
            for method in listed.split(", "):
                give(method, f"cannot run: {why}")
        elif not (line.startswith("LLAMAFILE") and "LLAMAFILE" in verdicts):
            give(line.split()[0], line)
    return verdicts


def test_methods_line_gives_every_method_one_verdict(kt_kernel_build) -> None:
    kt_kernel_build(ZEN4_BUILD)
    reason = fastest_here(None).reason
    verdicts = methods_line(reason)
    assert set(verdicts) == set(KT_METHODS), reason
    assert "the fastest here" in verdicts["LLAMAFILE"] and "Q4_K_M GGUF" in verdicts["LLAMAFILE"]
    assert "within the measurement's noise" in verdicts["AMXINT8"]
    assert "2.5x the fastest's time" in verdicts["AMXINT4"]
    assert verdicts["FP8"] == "not measured" and verdicts["SYCL_GPTQ_INT4"].startswith("cannot run: an Intel GPU")
    # each measured method's verdict on the cpu line is its row's on the methods line
    for method in ("LLAMAFILE", "AMXINT8", "AMXINT4", "BF16"):
        relative = check_cpu(method, ZEN4_FLAGS).reason.split(" at batch 1, ")[1].split("; the fastest")[0]
        assert relative in verdicts[method], (method, relative, verdicts[method])


def test_all_cores_warns_of_oversubscription() -> None:
    verdict = check_threads(112, 112)
    assert verdict.level == WARN and "13-26x" in verdict.reason and "KT_CPUINFER=110" in verdict.reason
    assert check_threads(110, 112).level == OK
    default = check_threads(110, 112, vllm_cores="free", by_default=True)
    assert "(the default: usable cores - 2)" in default.reason and "KT_VLLM_CORES=free" in default.reason
    assert (
        "the default" not in check_threads(110, 112).reason and "KT_VLLM_CORES=shared" in check_threads(110, 112).reason
    )


@pytest.mark.parametrize("pools,nodes,level", [(3, 2, ERROR), (1, 2, WARN), (2, 2, OK), (1, 1, OK)])
def test_thread_pools_against_numa_nodes(pools: int, nodes: int, level: str) -> None:
    assert check_numa(pools, nodes).level == level


def test_versions() -> None:
    verdicts = check_versions({"kt-kernel": None, "vllm": "0.31.1", "torch": "2.13.0"}, "kt_kernel")
    assert [v.level for v in verdicts] == [ERROR, WARN, OK]
    assert check_versions({"kt-kernel": None}, "torch")[0].level == WARN


def small_qwen3(model: Path) -> Path:
    """config.json and BF16 experts of a tiny Qwen3-MoE (3 layers, 4 experts of 256 x 128)."""
    from safetensors.torch import save_file

    model.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen3_moe", "num_hidden_layers": 3, "num_experts": 4, "hidden_size": 128}
    (model / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 256}))
    shapes = {"gate_proj": (256, 128), "up_proj": (256, 128), "down_proj": (128, 256)}
    tensors = {
        f"model.layers.{layer}.mlp.experts.{e}.{p}.weight": torch.zeros(shape, dtype=torch.bfloat16)
        for layer in range(3)
        for e in range(4)
        for p, shape in shapes.items()
    }
    save_file(tensors, str(model / "model.safetensors"))
    return model


def test_amx_weights_in_kt_layout(tmp_path: Path) -> None:
    from vllm_kt_tools.support.kt_weight_layouts import fake_layers

    layers = fake_layers(small_qwen3(tmp_path / "model"), tmp_path / "layers", "AMXINT4", pools=2)
    verdict = check_weights("AMXINT4", str(layers), None, pools=2)
    assert verdict.level == OK and "layers 0..2; 2 NUMA pools" in verdict.reason, verdict
    assert "pass --model DIR" in verdict.reason  # without the model's config: the kind of weights only


@pytest.mark.parametrize(
    "method,file,level",
    [
        ("AMXINT4", "converted", OK),  # kt quant's merged output
        ("AMXINT4", "model.gguf", ERROR),
        ("LLAMAFILE", "model-Q4_K_M.gguf", OK),
        # kt-kernel reads the .gguf files directly in the folder, not in subfolders
        ("LLAMAFILE", "sub/model-Q4_K_M.gguf", ERROR),
        ("LLAMAFILE", "checkpoint", ERROR),
        ("BF16", "checkpoint", OK),
        ("FP8", "model.gguf", ERROR),
        ("MOE_INT4", "anything.bin", ERROR),
    ],
)
def test_weight_files_against_the_method(tmp_path: Path, method: str, file: str, level: str) -> None:
    """Without --model, what the folder holds against what the method reads (serve's check:
    tests/unit/test_weight_paths.py)."""
    from vllm_kt_tools.support.kt_weight_layouts import convert_layers, fake_layers

    weights = tmp_path / "weights"
    if file == "checkpoint":
        small_qwen3(weights)
    elif file == "converted":
        model = small_qwen3(tmp_path / "model")
        weights = convert_layers(fake_layers(model, tmp_path / "layers", "AMXINT4"), model, tmp_path, "AMXINT4")
    else:
        (weights / file).parent.mkdir(parents=True, exist_ok=True)
        (weights / file).write_bytes(b"")
    assert check_weights(method, str(weights), None).level == level


def test_weights_default_to_the_model_dir_only_for_checkpoint_methods(tmp_path: Path) -> None:
    model = small_qwen3(tmp_path / "model")
    assert check_weights("BF16", None, str(model)).level == OK
    assert check_weights("AMXINT4", None, str(model)).level == OK  # quantized online, cached
    assert check_weights("BF16", None, None).level == WARN
    (tmp_path / "empty").mkdir()
    assert check_weights("BF16", None, str(tmp_path / "empty")).level == ERROR  # no *.safetensors


def test_ram_against_the_cpu_experts() -> None:
    need = estimate_model_memory(QWEN3_30B).cpu_expert_bytes("BF16")
    assert need is not None and 50 * GIB < need < 60 * GIB  # 48 layers x 128 experts x 9 MiB
    assert check_ram("BF16", QWEN3_30B, need - 1).level == ERROR
    assert check_ram("BF16", QWEN3_30B, int(need / 0.95)).level == WARN
    assert check_ram("BF16", QWEN3_30B, 2 * need).level == OK
    assert check_ram("AMXINT4", QWEN3_30B, need // 2).level == OK  # int4 is a quarter of bf16
    assert check_ram("LLAMAFILE", QWEN3_30B, need).level == WARN
    assert check_ram("BF16", None, need).level == WARN


def test_ram_counts_the_staging_copy() -> None:
    """With staging forced on, the CPU experts' BF16 copy (95 of 128 experts here) adds to
    kt-kernel's AMXINT4 experts: a quarter of BF16 fits where int4 plus the copy does not."""
    bf16 = estimate_model_memory(QWEN3_30B).cpu_expert_bytes("BF16")
    assert bf16 is not None
    room = bf16 // 2
    assert check_ram("AMXINT4", QWEN3_30B, room).level == OK
    with_copy = check_ram("AMXINT4", QWEN3_30B, room, staged_gpu_experts=33)
    assert with_copy.level == ERROR and "pinned for staging" in with_copy.reason, with_copy
    assert check_ram("AMXINT4", QWEN3_30B, 2 * bf16, staged_gpu_experts=33).level == OK
    # kt-kernel writes BF16 experts out itself: only two host buffers of one layer's
    # CPU experts (95 of 128) count, not a copy of every layer.
    memory = estimate_model_memory(QWEN3_30B)
    buffers = 2 * 95 * memory.expert_bytes
    assert host_copy_bytes(memory, 33, "BF16") == buffers
    assert check_ram("BF16", QWEN3_30B, bf16 + buffers - 1, staged_gpu_experts=33).level == ERROR
    assert check_ram("BF16", QWEN3_30B, 2 * bf16, staged_gpu_experts=33).level == OK


def test_ram_counts_the_fp8_copy() -> None:
    """The block-FP8 copy (a byte a weight plus block scales) instead of the BF16 one."""
    memory = estimate_model_memory(QWEN3_30B)
    int4 = memory.cpu_expert_bytes("AMXINT4")
    assert int4 is not None
    fp8 = host_copy_bytes(memory, 33, "AMXINT4", fp8_copy=True)
    bf16 = host_copy_bytes(memory, 33, "AMXINT4")
    room = int4 + (fp8 + bf16) // 2  # fits the FP8 copy, not the BF16 one
    assert check_ram("AMXINT4", QWEN3_30B, room, staged_gpu_experts=33).level == ERROR
    with_fp8 = check_ram("AMXINT4", QWEN3_30B, room, staged_gpu_experts=33, fp8_copy=True)
    assert with_fp8.level != ERROR and "block-FP8 copy" in with_fp8.reason, with_fp8
    assert check_ram("AMXINT4", QWEN3_30B, 10 * room, staged_gpu_experts=33, fp8_copy=True).level == OK


def test_ram_reads_the_staging_plan() -> None:
    """What the RAM check counts is the staging plan's: a number forces the copy (sized for
    every expert with KT_NUM_GPU_EXPERTS=auto), auto counts none, and auto's FP8 copy is on
    for AMXINT4 on a GPU with FP8 and off without one."""
    from vllm_kt_plugin.settings.variables import KTSettings
    from vllm_kt_tools.cli.doctor import staging_ram

    def settings(**env: str) -> KTSettings:
        return KTSettings.from_env({"KT_METHOD": "AMXINT4", **env}, cores=4, numa_nodes=1)

    assert staging_ram(settings(KT_STAGING_MIN_TOKENS="2048", KT_NUM_GPU_EXPERTS="33"), QWEN3_30B, None) == (33, False)
    assert staging_ram(settings(KT_STAGING_MIN_TOKENS="2048", KT_NUM_GPU_EXPERTS="auto"), QWEN3_30B, (9, 0)) == (
        0,
        True,
    )
    assert staging_ram(settings(), QWEN3_30B, (9, 0)) == (None, True)
    assert staging_ram(settings(KT_STAGING_MIN_TOKENS="0"), QWEN3_30B, (9, 0)) == (None, False)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    return tmp_path


def test_good_setup_exits_zero(tiny_model, capsys: pytest.CaptureFixture[str]) -> None:
    """A real checkpoint (serve's checks read its weight files' headers: the config-only
    directory above would be refused, as serve refuses it)."""
    env = {"KT_METHOD": "BF16", "KT_CPUINFER": "100", "KT_THREADPOOL_COUNT": "2"}
    assert doctor(str(tiny_model("qwen3_moe")), env, machine()) == 0
    out = capsys.readouterr().out
    checks = ("settings", "serve", "cpu", "methods", "threads", "numa", "kt-kernel", "vllm", "torch", "weights", "ram")
    for check in checks:
        assert f"OK     {check}" in out or check == "cpu", out
    # on the AMX build BF16 is measured well behind AMXINT4: the one warning says so
    assert "0 error(s), 1 warning(s)" in out and "WARN   cpu" in out and "the fastest: AMXINT4" in out, out


def test_default_method_follows_the_checkpoint(model_dir: Path) -> None:
    verdicts = run_checks({}, machine(), str(model_dir))
    cpu = next(v for v in verdicts if v.check == "cpu")
    assert "KT_METHOD=BF16: " in cpu.reason


def test_every_problem_is_reported(model_dir: Path, kt_kernel_build, capsys: pytest.CaptureFixture[str]) -> None:
    kt_kernel_build(ZEN4_BUILD)
    small_amd = machine(
        cpu_flags=ZEN4_FLAGS,
        usable_cores=16,
        numa_nodes=1,
        mem_available_bytes=mem_available_from_meminfo("MemAvailable:   8000000 kB\n"),
    )
    env = {"KT_METHOD": "AMXINT4", "KT_CPUINFER": "16", "KT_WEIGHT_PATH": str(model_dir / "missing")}
    assert doctor(str(model_dir), env, small_amd) == 1
    out = capsys.readouterr().out
    assert "ERROR  settings   KT_WEIGHT_PATH=" in out  # a bad variable is still reported, the rest still runs
    assert "WARN   cpu" in out and "WARN   threads" in out and "ERROR  ram" in out
    # the settings' line again, as serve would say it (with the raw value doctor was given)
    assert f"ERROR  weights    KT_WEIGHT_PATH='{model_dir / 'missing'}' is invalid (no such directory)" in out


def test_unreadable_model_config(tmp_path: Path) -> None:
    verdicts = run_checks({"KT_METHOD": "BF16"}, machine(), str(tmp_path))
    assert any(v.check == "model" and v.level == ERROR and "config.json" in v.reason for v in verdicts)


def test_a_model_name_is_read_as_vllm_serve_reads_it(tiny_model, tmp_path: Path) -> None:
    """``vllm-kt doctor --model org/name``, as ``vllm serve org/name`` takes it: the config
    comes from the Hugging Face cache (offline here: a cache laid out as the hub writes it),
    and serve's checks run on it; a name found nowhere is one clear error."""
    import shutil

    snapshot = tmp_path / "hub" / "models--kt-test--tiny-qwen3" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model("qwen3_moe"), snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KT_", "HF_"))}
    env |= {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "KT_METHOD": "BF16"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))

    def doctor_lines(model: str, **kt: str) -> list[str]:
        command = [sys.executable, "-m", "vllm_kt_tools.cli.main", "doctor", "--model", model]
        proc = subprocess.run(command, capture_output=True, text=True, env={**env, **kt}, timeout=300)
        return proc.stdout.splitlines()

    assert any(line.startswith("OK     serve") for line in doctor_lines("kt-test/tiny-qwen3"))
    refused = [line for line in doctor_lines("kt-test/tiny-qwen3", KT_NUM_GPU_EXPERTS="16") if "serve" in line]
    assert refused and refused[0].startswith("ERROR") and "KT_NUM_GPU_EXPERTS" in refused[0], refused
    missing = [line for line in doctor_lines("kt-test/no-such-model") if line.split()[1:2] == ["model"]]
    assert missing and missing[0].startswith("ERROR") and "kt-test/no-such-model" in missing[0], missing


def test_doctor_command_on_this_machine() -> None:
    """The real command, reading this machine's /proc and loading its kt-kernel build: the
    CPU verdict on KT_METHOD is that build's, and the exit status follows the verdicts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["KT_METHOD"] = "AMXINT4"
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_kt_tools.cli.main", "doctor"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    lines = proc.stdout.splitlines()
    verdict_of = {line.split()[1]: line.split()[0] for line in lines[:-1] if not line.startswith(" ")}
    assert set(verdict_of) == {
        "settings",
        "cpu",
        "methods",
        "threads",
        "numa",
        "kt-kernel",
        "vllm",
        "torch",
        "weights",
        "ram",
    }
    build = REAL_LOADED_BUILD()
    assert verdict_of["methods"] == OK and f"on kt-kernel's {build.variant} build" in proc.stdout
    assert set(methods_line(proc.stdout.split("methods    ", 1)[1].split("\nWARN")[0].split("\nOK")[0])) == set(
        KT_METHODS
    ), proc.stdout
    assert verdict_of["cpu"] == build.verdict("AMXINT4")[0], proc.stdout
    assert verdict_of["weights"] == OK  # AMXINT4 without KT_WEIGHT_PATH: quantized online
    errors = list(verdict_of.values()).count(ERROR)
    assert proc.returncode == (1 if errors else 0) and lines[-1].startswith(f"{errors} error(s)")


@pytest.mark.parametrize(
    "flags,variant,features",
    [
        (cpu_flags_from_cpuinfo(SAPPHIRE_RAPIDS_CPUINFO), "amx", "AMX yes, AVX-512 yes, AVX-512-BF16 yes, AVX2 yes"),
        (ZEN4_FLAGS, "avx512_bf16", "AMX no, AVX-512 yes, AVX-512-BF16 yes, AVX2 yes"),
        (frozenset({"avx", "avx2"}), "avx2", "AMX no, AVX-512 no, AVX-512-BF16 no, AVX2 yes"),
    ],
)
def test_doctor_with_nothing_set_says_what_this_cpu_runs(
    kt_kernel_build, flags: frozenset[str], variant: str, features: str
) -> None:
    """The first thing a new user types: no KT_* variable, no model. The cpu line names the
    CPU's features and kt-kernel's build; the methods line gives every KT_METHOD one verdict
    on that build, from the shipped table where it measured the method, and each agrees
    with the cpu line's verdict on that method."""
    build = kt_kernel_build(variant)
    verdicts = {v.check: v for v in run_checks({}, machine(cpu_flags=flags))}
    assert verdicts["cpu"].reason.startswith(f"{features}: kt-kernel loads its {variant} build"), verdicts["cpu"]
    by_method = methods_line(verdicts["methods"].reason)
    assert set(by_method) == set(KT_METHODS), verdicts["methods"].reason
    assert "the fastest here" in by_method[build.measured[0].method]
    for method in KT_METHODS:
        level, verdict = check_cpu(method, flags).level, check_cpu(method, flags).reason
        if method in CANNOT_RUN[variant]:
            assert level == ERROR and by_method[method].startswith("cannot run"), (method, verdict)
        elif "not measured" in verdict:
            assert level == OK and by_method[method] == "not measured", (method, verdict)
        else:
            relative = verdict.split(" at batch 1, ")[1].split("; the fastest")[0]
            assert relative in by_method[method], (method, verdict, by_method[method])


def test_pipeline_stages_on_one_host_share_its_cores(model_dir: Path) -> None:
    """Two pipeline stages here run two kt-kernel processes: the default threads are
    halved and pooled per NUMA node; an explicit KT_CPUINFER sized for one process warns."""
    verdicts = run_checks({"KT_METHOD": "BF16"}, machine(), str(model_dir), 2, 2)
    by_check = {v.check: v for v in verdicts}
    assert by_check["parallel"].level == OK and "2 kt-kernel process(es)" in by_check["parallel"].reason
    assert by_check["threads"].level == OK
    assert "KT_CPUINFER=55 in each of 2 kt-kernel processes" in by_check["threads"].reason
    crowded = {v.check: v for v in run_checks({"KT_METHOD": "BF16", "KT_CPUINFER": "100"}, machine(), None, 1, 2)}
    assert crowded["threads"].level == WARN and "2 pipeline stages" in crowded["threads"].reason
    # Tensor parallelism alone: one kt-kernel process (rank 0), nothing divided.
    alone = {v.check: v for v in run_checks({"KT_METHOD": "BF16"}, machine(), None, 4, 1)}
    assert "parallel" not in alone
    assert "KT_CPUINFER=110 (the default: usable cores - 2) of 112 usable cores" in alone["threads"].reason


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_doctor_refuses_a_parallel_size_below_one(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_kt_tools.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["doctor", flag, "0"])
    assert exit_info.value.code == 2 and f"{flag}: '0': must be >= 1" in capsys.readouterr().err
