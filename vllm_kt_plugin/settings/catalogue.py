"""Every KT_* variable the plugin reads, one entry each: name, default, allowed values,
meaning, parser, value when unset and former names (``VARIABLES``).

The bottom of the package, like vLLM's ``vllm/envs.py``: it imports nothing else from
``vllm_kt_plugin``. ``KTSettings.from_env`` parses every entry with its parser, and
docs/settings.md is generated from the entries' texts. A variable set to ``auto`` parses
to ``AUTO`` whatever it sets; checks between variables live above.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Under vLLM's logger tree, so messages appear (and are filtered) like vLLM's own.
LOGGER_NAME = "vllm.kt_hybrid"
SETTINGS_PREFIX = "KT_"  # of every setting, and of kt-kernel's own variables

# 1 GB in every KT_* setting and log line is 2**30 bytes, the unit GPU memory is quoted in
# (an "80 GB" A100 has 80 GiB).
GIB = 2**30

DEFAULT_BACKEND = "kt_kernel"
# Cores left to vLLM by the default KT_CPUINFER: kt-kernel's spinning workers plus the
# Python and CUDA-callback threads oversubscribe a fully used CPU (13-26x slower measured).
RESERVED_CORES = 2
# KT_VLLM_CORES: where vLLM's threads in kt-kernel's process may run (cpu_backends/kt_kernel/cores.py)
VLLM_CORES = ("auto", "shared", "free")

# KT_STAGING_MIN_TOKENS=auto where the split cannot run (tensor parallelism: the host copy
# holds each rank's shard): from this size the whole-layer stream beat the CPU path in
# `vllm-kt bench`'s layer timing on the H200 host (docs/design.md, "Staging").
WHOLE_LAYER_AUTO_MIN_TOKENS = 2048

# KT_STAGING_GATHER_MS, the scheduler's wait for more prompts to join a forward that streams
# the whole layer (~390 ms on the H100 whatever its size, docs/split.md): a lone prompt's first
# token is late by at most this. The class vLLM loads by name for it (hybrid/scheduler.py).
STAGING_GATHER_MS = 30.0
GATHERING_SCHEDULER = "vllm_kt_plugin.hybrid.scheduler.KTHybridScheduler"

# kt-kernel 0.7.2's inference methods (kt_kernel.experts.INFERENCE_METHODS; a test keeps
# this copy equal to it, so KT_METHOD's help can list them without importing kt-kernel).
KT_METHODS = (
    "AMXINT4",
    "AMXINT8",
    "BF16",
    "FP8",
    "FP8_PERCHANNEL",
    "RAWINT4",
    "GPTQ_INT4",
    "SYCL_GPTQ_INT4",
    "MXFP4",
    "NVFP4",
    "MXFP8",
    "LLAMAFILE",
    "MOE_INT4",
    "MOE_INT8",
)


# kt-kernel methods that write their experts back in the layout of vLLM's Triton MoE kernels
# (NativeMoEWrapper.submit_write_weight_scale_to_buffer), with the checkpoint format that
# layout is: staging then needs no second copy of those experts in RAM.
UNQUANTIZED, BLOCK_FP8 = "unquantized", "block-FP8"
KT_GPU_LAYOUT_WRITERS = {"BF16": UNQUANTIZED, "FP8": BLOCK_FP8}

# KT_EXPERT_PLACEMENT values: which experts of each layer go to the GPU.
PLACEMENT_STRATEGIES = ("uniform", "front-loading", "random", "frequency")

# Variables kt-kernel 0.7.2 itself reads; they share our prefix and are not typos.
KT_KERNEL_OWN_VARIABLES = frozenset(
    {
        "KT_ADAPTER_MANIFEST_NAME",
        "KT_EXTERNAL_NPU_REPORT_SUBSCRIBER",
        "KT_FORCE_SYNC_SUBMIT",
        "KT_GPTQ_INT4_BACKEND",
        "KT_INT8_VNNI_BACKEND",
        "KT_KERNEL_CPU_VARIANT",
        "KT_KERNEL_DEBUG",
        "KT_LANG",
        "KT_MXFP4_BACKEND",
        "KT_MXFP8_BACKEND",
        "KT_NON_EXPERT_MANIFEST_NAME",
        "KT_RAWINT4_BACKEND",
        "KT_REUSE_CHECKPOINT_FORWARD",
        "KT_SFT_DEBUG",
        "KT_SFT_ENABLE_WARMUP",
    }
)


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/vllm-kt-plugin`` (``~/.cache/...``): online weights, the demo's
    tiny model and benchmark files all live under it."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-kt-plugin"


def default_cache_dir() -> Path:
    """KT_CACHE_DIR when unset."""
    return cache_root() / "kt-weights"


# --- parsers: the text of a set variable (stripped, not empty) -> its value -------------
# A parser raises ValueError with the reason; ``variables.parse_variable`` turns it into
# the KTConfigError line that names the variable, its value and what the catalogue allows.


class Auto:
    """The one ``auto`` value (compare with ``is``)."""

    def __repr__(self) -> str:
        return "AUTO"

    def __reduce__(self) -> str:
        # vLLM pickles the settings into its workers: unpickled, AUTO is still this module's AUTO
        return "AUTO"


AUTO = Auto()  # the value of every variable set to ``auto``, until what it decides is known
AUTO_METHOD = AUTO  # KT_METHOD=auto: the backend picks the method


def integer(minimum: int, *, auto: bool = False) -> Callable[[str], Any]:
    """An integer >= ``minimum`` (or ``auto``, giving AUTO, where ``auto``)."""

    def parse(raw: str) -> Any:
        if auto and raw.lower() == "auto":
            return AUTO
        try:
            value = int(raw)
        except ValueError:
            raise ValueError("not an integer") from None
        if value < minimum:
            raise ValueError(f"must be >= {minimum}")
        return value

    return parse


def number(minimum: float, maximum: float | None = None, *, above_minimum: bool = False) -> Callable[[str], float]:
    """A number in [minimum, maximum] (above ``minimum`` where ``above_minimum``)."""

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError("not a number") from None
        if not value >= minimum or (maximum is not None and value > maximum):  # `not >=` also catches nan
            raise ValueError(
                f"must be in [{minimum:g}, {maximum:g}]" if maximum is not None else f"must be >= {minimum:g}"
            )
        if above_minimum and value == minimum:
            raise ValueError(f"must be > {minimum:g}")
        return value

    return parse


def share(raw: str) -> Any:
    """``auto`` (AUTO), or a number strictly between 0 and 1 (a share of something)."""
    if raw.lower() == "auto":
        return AUTO
    value = number(0.0, 1.0)(raw)
    if not 0 < value < 1:
        raise ValueError("a share of the picked CPU experts must lie strictly between 0 and 1")
    return value


def flag(raw: str) -> bool:
    """0 or 1."""
    if raw not in ("0", "1"):
        raise ValueError("must be 0 or 1")
    return raw == "1"


def auto_flag(raw: str) -> Any:
    """``auto`` (AUTO), 0 or 1."""
    if raw.lower() == "auto":
        return AUTO
    if raw not in ("0", "1"):
        raise ValueError("must be auto, 0 or 1")
    return raw == "1"


def text(raw: str) -> str:
    return raw


def method_name(raw: str) -> Any:
    """``auto`` (AUTO), or a method name, upper-cased."""
    return AUTO if raw.lower() == "auto" else raw.upper()


def one_of(choices: tuple[str, ...], reason: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw.lower() not in choices:
            raise ValueError(reason)
        return raw.lower()

    return parse


def existing_directory(raw: str) -> str:
    path = Path(raw).expanduser()
    if not path.exists():
        raise ValueError("no such directory")
    if not path.is_dir():
        raise ValueError("not a directory")
    return str(path.resolve())


def existing_weight_path(raw: str) -> str:
    """A directory, or a .gguf file (LLAMAFILE reads one file, or a split set from its first)."""
    path = Path(raw).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.resolve())
    return existing_directory(raw)


def writable_directory(raw: str) -> str:
    """Created now: one that cannot be written would otherwise fail only after vLLM has
    loaded every GPU weight and quantized the first layer."""
    where = Path(raw).expanduser()
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create it: {exc.strerror}") from None
    if not where.is_dir() or not os.access(where, os.W_OK | os.X_OK):
        raise ValueError("not a writable directory")
    return str(where.resolve())


def absolute_path(raw: str) -> str:
    return str(Path(raw).expanduser().resolve())


@dataclass(frozen=True)
class Variable:
    """One KT_* variable: its name; ``default``, ``allowed`` and ``help``, the texts of the
    settings document (docs/settings.md) and of error messages; ``parse``, the parser of
    a set value; ``unset``, its value when unset (a callable is called each time);
    ``field``, the KTSettings field it sets (None: read elsewhere, e.g. KT_CONFIG); and
    ``old_names``, names it had before, still read (with a notice naming this one)."""

    name: str
    default: str
    allowed: str
    help: str
    parse: Callable[[str], Any] = text
    unset: Any = None
    field: str | None = None
    old_names: tuple[str, ...] = ()

    def unset_value(self) -> Any:
        return self.unset() if callable(self.unset) else self.unset


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "KT_BACKEND",
        DEFAULT_BACKEND,
        "a registered CPU-expert backend: kt_kernel, torch, or one from an installed plugin",
        "which code computes the CPU experts",
        text,
        DEFAULT_BACKEND,
        "backend",
    ),
    Variable(
        "KT_METHOD",
        "from the checkpoint (BF16 for unquantized, FP8 / FP8_PERCHANNEL / GPTQ_INT4 / RAWINT4); LLAMAFILE when "
        "KT_WEIGHT_PATH names GGUF weights",
        f"a kt-kernel inference method ({', '.join(KT_METHODS)}), or auto (the fastest measured on this CPU's "
        "kt-kernel variant that these weights allow); torch backend: BF16",
        "how the CPU experts are stored and computed",
        method_name,
        None,
        "method",
    ),
    Variable(
        "KT_WEIGHT_PATH",
        "the model directory, for methods that read the Hugging Face checkpoint",
        "an existing directory holding the CPU expert weights in KT_METHOD's format; for LLAMAFILE also a .gguf file "
        "(the first of a llama.cpp split set reads the whole set)",
        "where kt-kernel reads the CPU experts",
        existing_weight_path,
        None,
        "weight_path",
    ),
    Variable(
        "KT_CACHE_DIR",
        "$XDG_CACHE_HOME/vllm-kt-plugin/kt-weights (~/.cache/... without XDG_CACHE_HOME)",
        "a directory that exists or can be created, and is writable",
        "where AMXINT4/AMXINT8 CPU experts quantized online are kept (one folder per model, method, pools)",
        writable_directory,
        lambda: str(default_cache_dir()),
        "cache_dir",
    ),
    Variable(
        "KT_NUM_GPU_EXPERTS",
        "0",
        "an integer from 0 to the number of routed experts per layer, or auto (as many as fit the GPU)",
        "experts per MoE layer kept on the GPU (which ones: KT_EXPERT_PLACEMENT)",
        integer(0, auto=True),
        0,
        "num_gpu_experts",
    ),
    Variable(
        "KT_GPU_EXPERTS_RATIO",
        "unset",
        "a number from 0 to 1, not together with KT_NUM_GPU_EXPERTS",
        "fraction of each layer's routed experts kept on the GPU (rounded)",
        number(0.0, 1.0),
        None,
        "gpu_experts_ratio",
    ),
    Variable(
        "KT_KV_CACHE_RESERVE_GB",
        "20% of the memory vLLM is granted, at least 2",
        "a number >= 0 (GB = 2**30 bytes)",
        "GPU memory KT_NUM_GPU_EXPERTS=auto leaves for the KV cache, activations and CUDA graphs",
        number(0.0),
        None,
        "kv_cache_reserve_gb",
    ),
    Variable(
        "KT_GPU_MEMORY_GB",
        "measured by vLLM's platform (NVML); unset without a CUDA GPU",
        "a number > 0 (GB = 2**30 bytes, e.g. 80 for an 80 GB A100/H100)",
        "GPU size used by KT_NUM_GPU_EXPERTS=auto and by a KT_CONFIG preset's table",
        number(0.0, above_minimum=True),
        None,
        "gpu_memory_gb",
    ),
    Variable(
        "KT_EXPERT_PLACEMENT",
        "uniform",
        f"{', '.join(PLACEMENT_STRATEGIES)} (frequency needs KT_EXPERT_PROFILE)",
        "which experts of each layer go to the GPU",
        one_of(PLACEMENT_STRATEGIES, "unknown strategy"),
        "uniform",
        "expert_placement",
    ),
    Variable(
        "KT_EXPERT_PROFILE",
        "unset",
        'an existing JSON routing profile {"model", "num_experts", "layers": {"<layer>": [count per expert]}}',
        "expert activation counts for KT_EXPERT_PLACEMENT=frequency",
        absolute_path,  # read (and checked) by the loader
        None,
        "expert_profile",
    ),
    Variable(
        "KT_EXPERT_PLACEMENT_SEED",
        "0",
        "an integer >= 0",
        "seed of KT_EXPERT_PLACEMENT=random",
        integer(0),
        0,
        "expert_placement_seed",
    ),
    Variable(
        "KT_CONFIG",
        "unset",
        "a preset name from configs/ (e.g. deepseek-v3, qwen3-30b-a3b) or the path of a preset YAML file",
        "preset settings for a model; KT_* variables override them",
        # read by the loader, which lays the preset under the environment
    ),
    Variable(
        "KT_CPUINFER",
        f"usable cores - {RESERVED_CORES}, at least 1",
        "a positive integer",
        "CPU threads computing experts",
        integer(1),
        None,  # divided from the host's usable cores (KTSettings.cpuinfer_threads)
        "requested_threads",
    ),
    Variable(
        "KT_VLLM_CORES",
        "auto (shared; free is for measuring it, docs/benchmarks.md)",
        "auto, shared or free",
        "where vLLM's own threads in kt-kernel's process run: on any core (shared) or only on the cores "
        "kt-kernel's pinned workers leave free (free)",
        one_of(VLLM_CORES, "unknown choice"),
        "auto",
        "vllm_cores",
    ),
    Variable(
        "KT_THREADPOOL_COUNT",
        "1",
        "a positive integer, at most the NUMA node count and at most KT_CPUINFER",
        "thread pools (one per NUMA node)",
        integer(1),
        1,
        "threadpool_count",
    ),
    Variable(
        "KT_CHUNKED_PREFILL_SIZE",
        "vLLM's max_num_batched_tokens",
        "an integer >= vLLM's max_num_batched_tokens",
        "tokens kt-kernel's buffers hold per forward",
        integer(1),
        None,
        "chunked_prefill_size",
    ),
    Variable(
        "KT_MAX_DEFERRED_EXPERTS_PER_TOKEN",
        "0",
        "an integer from 0 to top_k - 1",
        "CPU experts per token whose result is added one layer later (0 on the last MoE layer)",
        integer(0),
        0,
        "max_deferred_experts_per_token",
    ),
    Variable(
        "KT_STAGING_MIN_TOKENS",
        "auto: under CUDA, each forward above the largest CUDA-graph batch takes the CPU path, the split or the "
        "whole layer, as a cost model probed at start-up predicts fastest (with tensor parallelism: the whole layer "
        f"from {WHOLE_LAYER_AUTO_MIN_TOKENS} tokens), where the CPU experts can be staged (unquantized on vLLM's "
        "Triton kernels, or block-FP8 with KT_METHOD=FP8) and the staging fits; else off",
        "auto, or an integer >= 0 (0 = off)",
        "from how many tokens a forward stages CPU experts on the GPU; an integer N: forwards of at least N tokens "
        "stage every CPU expert (the whole layer, streamed in layer by layer; docs/split.md)",
        integer(0, auto=True),
        AUTO,
        "staging_min_tokens",
        ("KT_GPU_PREFILL_MIN_TOKENS",),
    ),
    Variable(
        "KT_STAGING_SPLIT",
        "auto (the cost model under KT_STAGING_MIN_TOKENS=auto; the whole layer under a number)",
        "auto, or a number strictly between 0 and 1",
        "a share: forwards that stage CPU experts stage that share of their picked CPU experts (most-picked first) "
        "on the GPU and leave the rest to the CPU; for tests and measurements (docs/split.md)",
        share,
        AUTO,
        "staging_split",
        ("KT_GPU_PREFILL_SPLIT",),
    ),
    Variable(
        "KT_STAGING_FP8_COPY",
        "auto: on with AMXINT4 CPU experts of a BF16/FP16 checkpoint on a GPU with FP8 (compute capability "
        ">= 8.9), one tensor-parallel rank (its drift is within AMXINT4's own); else off (docs/split.md)",
        "auto, 0 or 1; 1 needs staging on and a BF16/FP16 checkpoint on one tensor-parallel rank",
        "1: the host copy of the CPU experts that staging streams to the GPU is block FP8 (128 x 128 blocks, "
        "float32 scales) instead of the checkpoint's BF16: half the RAM and half the bytes over PCIe; the GPU "
        "computes those experts in FP8",
        auto_flag,
        AUTO,
        "staging_fp8_copy",
        ("KT_GPU_PREFILL_FP8_COPY",),
    ),
    Variable(
        "KT_STAGING_GATHER_MS",
        f"{STAGING_GATHER_MS:g}, with kt-hybrid's scheduler only (--scheduler-cls {GATHERING_SCHEDULER})",
        "a number of milliseconds from 0 to 10000 (0 = off); not above 0 with KT_STAGING_MIN_TOKENS=0",
        "while no request runs, kt-hybrid's scheduler holds waiting prompts large enough to stream the whole layer "
        "up to N ms after the oldest arrived, so that prompts sent together share one forward and its one copy of "
        "the CPU experts (docs/split.md)",
        number(0.0, 10000.0),
        STAGING_GATHER_MS,
        "staging_gather_ms",
        ("KT_GPU_PREFILL_GATHER_MS",),
    ),
    Variable(
        "KT_DYNAMIC_GPU_EXPERTS",
        "0 (off)",
        "an integer >= 0; needs KT_METHOD=BF16 and one tensor-parallel rank",
        "every N-th forward pass that runs outside CUDA graphs, each layer's most-picked CPU experts swap "
        "places with its least-picked GPU experts (routing counted on the device, CUDA graphs included)",
        integer(0),
        0,
        "dynamic_gpu_experts",
    ),
    Variable(
        "KT_METRICS_INTERVAL",
        "0 (off)",
        "a number of seconds >= 0",
        "log per-layer CPU-expert, GPU-expert and CPU-wait times every N seconds (also Prometheus counters)",
        number(0.0),
        0.0,
        "metrics_interval_s",
    ),
)
BY_NAME = {v.name: v for v in VARIABLES}
RENAMED = {old: v.name for v in VARIABLES for old in v.old_names}  # a former name -> the variable's name now
KNOWN_VARIABLES = frozenset(BY_NAME) | frozenset(RENAMED)
