"""KT_* environment variables: parsed and validated once, when the quant config is built.

Every mistake stops startup with one line naming the variable, the bad value and what is
allowed, before any weight is loaded. Checks that need the model (number of experts,
top-k) or vLLM's scheduler budget run as soon as those are known, still before weights.
"""

from __future__ import annotations

import difflib
import glob
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

# Under vLLM's logger tree, so messages appear (and are filtered) like vLLM's own.
LOGGER_NAME = "vllm.kt_hybrid"
logger = logging.getLogger(LOGGER_NAME)

DEFAULT_BACKEND = "kt_kernel"
RESERVED_CORES = 2

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


class KTConfigError(ValueError):
    """A KT_* setting is invalid; the message names the variable, value and what is allowed."""


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    allowed: str
    help: str


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "KT_BACKEND",
        DEFAULT_BACKEND,
        "a registered CPU-expert backend: kt_kernel, torch, or one from an installed plugin",
        "which code computes the CPU experts",
    ),
    Variable(
        "KT_METHOD",
        "from the checkpoint (BF16 for unquantized, FP8 / FP8_PERCHANNEL / GPTQ_INT4 / RAWINT4)",
        "a kt-kernel inference method (AMXINT4, AMXINT8, BF16, FP8, FP8_PERCHANNEL, RAWINT4, "
        "GPTQ_INT4, MXFP4, NVFP4, MXFP8, LLAMAFILE, MOE_INT4, MOE_INT8); torch backend: BF16",
        "how the CPU experts are stored and computed",
    ),
    Variable(
        "KT_WEIGHT_PATH",
        "the model directory, for methods that read the Hugging Face checkpoint",
        "an existing directory holding the CPU expert weights in KT_METHOD's format",
        "where kt-kernel reads the CPU experts",
    ),
    Variable(
        "KT_CACHE_DIR",
        "$XDG_CACHE_HOME/vllm-kt-plugin/kt-weights (~/.cache/... without XDG_CACHE_HOME)",
        "a directory that exists or can be created, and is writable",
        "where AMXINT4/AMXINT8 CPU experts quantized online are kept (one folder per model, method, pools)",
    ),
    Variable(
        "KT_NUM_GPU_EXPERTS",
        "0",
        "an integer from 0 to the number of routed experts per layer, or auto (as many as fit the GPU)",
        "experts per MoE layer kept on the GPU (which ones: KT_EXPERT_PLACEMENT)",
    ),
    Variable(
        "KT_GPU_EXPERTS_RATIO",
        "unset",
        "a number from 0 to 1, not together with KT_NUM_GPU_EXPERTS",
        "fraction of each layer's routed experts kept on the GPU (rounded)",
    ),
    Variable(
        "KT_KV_CACHE_RESERVE_GB",
        "20% of the memory vLLM is granted, at least 2",
        "a number >= 0 (GB = 2**30 bytes)",
        "GPU memory KT_NUM_GPU_EXPERTS=auto leaves for the KV cache, activations and CUDA graphs",
    ),
    Variable(
        "KT_GPU_MEMORY_GB",
        "measured by vLLM's platform (NVML); unset without a CUDA GPU",
        "a number > 0 (GB = 2**30 bytes, e.g. 80 for an 80 GB A100/H100)",
        "GPU size used by KT_NUM_GPU_EXPERTS=auto and by a KT_CONFIG preset's table",
    ),
    Variable(
        "KT_EXPERT_PLACEMENT",
        "uniform",
        "uniform, front-loading, random, frequency (frequency needs KT_EXPERT_PROFILE)",
        "which experts of each layer go to the GPU",
    ),
    Variable(
        "KT_EXPERT_PROFILE",
        "unset",
        'an existing JSON routing profile {"model", "num_experts", "layers": {"<layer>": [count per expert]}}',
        "expert activation counts for KT_EXPERT_PLACEMENT=frequency",
    ),
    Variable(
        "KT_EXPERT_PLACEMENT_SEED",
        "0",
        "an integer >= 0",
        "seed of KT_EXPERT_PLACEMENT=random",
    ),
    Variable(
        "KT_CONFIG",
        "unset",
        "a preset name from configs/ (e.g. deepseek-v3, qwen3-30b-a3b) or the path of a preset YAML file",
        "preset settings for a model; KT_* variables override them",
    ),
    Variable(
        "KT_CPUINFER",
        f"usable cores - {RESERVED_CORES}, at least 1",
        "a positive integer",
        "CPU threads computing experts",
    ),
    Variable(
        "KT_THREADPOOL_COUNT",
        "1",
        "a positive integer, at most the NUMA node count and at most KT_CPUINFER",
        "thread pools (one per NUMA node)",
    ),
    Variable(
        "KT_CHUNKED_PREFILL_SIZE",
        "vLLM's max_num_batched_tokens",
        "an integer >= vLLM's max_num_batched_tokens",
        "tokens kt-kernel's buffers hold per forward",
    ),
    Variable(
        "KT_MAX_DEFERRED_EXPERTS_PER_TOKEN",
        "0",
        "an integer from 0 to top_k - 1",
        "CPU experts per token whose result is added one layer later (0 on the last MoE layer)",
    ),
    Variable(
        "KT_METRICS_INTERVAL",
        "0 (off)",
        "a number of seconds >= 0",
        "log per-layer CPU-expert, GPU-expert and CPU-wait times every N seconds (also Prometheus counters)",
    ),
)
KNOWN_VARIABLES = frozenset(v.name for v in VARIABLES)
_BY_NAME = {v.name: v for v in VARIABLES}


def error_for(name: str, value: object, reason: str = "") -> KTConfigError:
    """The standard one-line error: variable, bad value, why, and what is allowed."""
    allowed = _BY_NAME[name].allowed
    why = f" ({reason})" if reason else ""
    return KTConfigError(f"{name}={value!r} is invalid{why}; allowed: {allowed}.")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-kt-plugin" / "kt-weights"


def check_cache_dir(path: str) -> str:
    """Create the cache directory now: one that cannot be written would otherwise fail
    only after vLLM has loaded every GPU weight and quantized the first layer."""
    where = Path(path).expanduser()
    name = "KT_CACHE_DIR"
    allowed = _BY_NAME["KT_CACHE_DIR"].allowed
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KTConfigError(
            f"{name}={path!r} is invalid (cannot create it: {exc.strerror}); allowed: {allowed}."
        ) from None
    if not where.is_dir() or not os.access(where, os.W_OK | os.X_OK):
        raise KTConfigError(f"{name}={path!r} is invalid (not a writable directory); allowed: {allowed}.")
    return str(where.resolve())


def usable_cores() -> int:
    """Cores this process may run on (affinity and cgroup-pinned sets respected)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def numa_node_count() -> int:
    nodes = glob.glob("/sys/devices/system/node/node[0-9]*")
    return max(1, len(nodes))


def default_cpuinfer_threads(cores: int) -> int:
    """All cores minus two: kt's spinning workers plus the Python and CUDA-callback
    threads oversubscribe a fully used CPU (13-26x slower measured on the H200 host)."""
    return max(1, cores - RESERVED_CORES)


def _int(env: Mapping[str, str], name: str, minimum: int) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise error_for(name, raw, "not an integer") from None
    if value < minimum:
        raise error_for(name, raw, f"must be >= {minimum}")
    return value


def _float(env: Mapping[str, str], name: str, minimum: float, maximum: float | None = None) -> float | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        raise error_for(name, raw, "not a number") from None
    if not value >= minimum or (maximum is not None and value > maximum):  # `not >=` also catches nan
        raise error_for(
            name, raw, f"must be in [{minimum:g}, {maximum:g}]" if maximum is not None else f"must be >= {minimum:g}"
        )
    return value


def _str(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    return raw.strip()


def warn_unknown_variables(env: Mapping[str, str]) -> list[str]:
    """Warn about KT_* names we do not know (likely typos); return them."""
    unknown = sorted(
        n for n in env if n.startswith("KT_") and n not in KNOWN_VARIABLES and n not in KT_KERNEL_OWN_VARIABLES
    )
    for name in unknown:
        close = difflib.get_close_matches(name, KNOWN_VARIABLES, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        logger.warning("kt-hybrid: ignoring unknown variable %s%s", name, hint)
    return unknown


@dataclass(frozen=True)
class KTEnvConfig:
    """Validated KT_* settings. ``None`` means "use the default that depends on the
    model or on vLLM", resolved by the ``resolve_*`` helpers once that is known."""

    backend: str = DEFAULT_BACKEND
    method: str | None = None
    weight_path: str | None = None
    num_gpu_experts: int = 0
    cpuinfer_threads: int = 1
    threadpool_count: int = 1
    chunked_prefill_size: int | None = None
    max_deferred_experts_per_token: int = 0
    cache_dir: str = field(default_factory=lambda: str(default_cache_dir()))
    gpu_experts_auto: bool = False  # KT_NUM_GPU_EXPERTS=auto; num_gpu_experts is then 0 until resolved
    gpu_experts_ratio: float | None = None
    kv_cache_reserve_gb: float | None = None
    gpu_memory_gb: float | None = None
    expert_placement: str = "uniform"
    expert_profile: str | None = None
    expert_placement_seed: int = 0
    metrics_interval_s: float = 0.0
    preset: str | None = None  # the KT_CONFIG preset file applied, for the log

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        cores: int | None = None,
        numa_nodes: int | None = None,
    ) -> KTEnvConfig:
        """Parse and check every KT_* variable that needs no model knowledge."""
        env = os.environ if env is None else env
        cores = usable_cores() if cores is None else cores
        numa_nodes = numa_node_count() if numa_nodes is None else numa_nodes
        warn_unknown_variables(env)
        preset = None
        if _str(env, "KT_CONFIG") is not None:
            from vllm_kt_plugin.presets import apply_preset

            env, preset = apply_preset(env, cores=cores, numa_nodes=numa_nodes)

        backend = _str(env, "KT_BACKEND") or DEFAULT_BACKEND
        method = _str(env, "KT_METHOD")
        if method is not None:
            method = method.upper()

        weight_path = _str(env, "KT_WEIGHT_PATH")
        if weight_path is not None:
            path = Path(weight_path).expanduser()
            if not path.exists():
                raise error_for("KT_WEIGHT_PATH", weight_path, "no such directory")
            if not path.is_dir():
                raise error_for("KT_WEIGHT_PATH", weight_path, "not a directory")
            weight_path = str(path.resolve())

        gpu_auto = (_str(env, "KT_NUM_GPU_EXPERTS") or "").lower() == "auto"
        num_gpu = None if gpu_auto else _int(env, "KT_NUM_GPU_EXPERTS", 0)
        ratio = _float(env, "KT_GPU_EXPERTS_RATIO", 0.0, 1.0)
        if ratio is not None and _str(env, "KT_NUM_GPU_EXPERTS") is not None:
            raise error_for(
                "KT_GPU_EXPERTS_RATIO", env["KT_GPU_EXPERTS_RATIO"], "KT_NUM_GPU_EXPERTS is set too; set only one"
            )
        placement, profile = _placement(env)
        threads = _int(env, "KT_CPUINFER", 1)
        if threads is None:
            threads = default_cpuinfer_threads(cores)
        elif threads >= cores:
            logger.warning(
                "kt-hybrid: KT_CPUINFER=%d uses all %d usable cores; kt-kernel's spinning "
                "workers then compete with vLLM's own threads (13-26x slower measured). "
                "Leave at least %d cores free, e.g. KT_CPUINFER=%d.",
                threads,
                cores,
                RESERVED_CORES,
                default_cpuinfer_threads(cores),
            )
        pools = _int(env, "KT_THREADPOOL_COUNT", 1) or 1
        if pools > numa_nodes:
            raise error_for(
                "KT_THREADPOOL_COUNT", env["KT_THREADPOOL_COUNT"], f"this machine has {numa_nodes} NUMA node(s)"
            )
        if pools > threads:
            raise error_for(
                "KT_THREADPOOL_COUNT", env["KT_THREADPOOL_COUNT"], f"only {threads} CPU thread(s) (KT_CPUINFER)"
            )
        chunk = _int(env, "KT_CHUNKED_PREFILL_SIZE", 1)
        deferred = _int(env, "KT_MAX_DEFERRED_EXPERTS_PER_TOKEN", 0) or 0
        cache_dir = _str(env, "KT_CACHE_DIR")

        return cls(
            backend=backend,
            method=method,
            weight_path=weight_path,
            num_gpu_experts=num_gpu or 0,
            cpuinfer_threads=threads,
            threadpool_count=pools,
            chunked_prefill_size=chunk,
            max_deferred_experts_per_token=deferred,
            cache_dir=check_cache_dir(cache_dir) if cache_dir else str(default_cache_dir()),
            gpu_experts_auto=gpu_auto,
            gpu_experts_ratio=ratio,
            kv_cache_reserve_gb=_float(env, "KT_KV_CACHE_RESERVE_GB", 0.0),
            gpu_memory_gb=parse_positive_float(env, "KT_GPU_MEMORY_GB"),
            expert_placement=placement,
            expert_profile=profile,
            expert_placement_seed=_int(env, "KT_EXPERT_PLACEMENT_SEED", 0) or 0,
            metrics_interval_s=_float(env, "KT_METRICS_INTERVAL", 0.0) or 0.0,
            preset=preset,
        )

    def with_method(self, method: str) -> KTEnvConfig:
        return replace(self, method=method)

    def check_model(self, num_experts: int, top_k: int) -> None:
        """Checks that need the model's expert count and top-k (known from its config)."""
        if num_experts <= 0:
            raise KTConfigError(
                "--quantization kt-hybrid needs a Mixture-of-Experts model; this model's "
                "config declares no routed experts."
            )
        if self.num_gpu_experts > num_experts:
            raise error_for(
                "KT_NUM_GPU_EXPERTS",
                str(self.num_gpu_experts),
                f"the model has {num_experts} routed experts per layer",
            )
        if top_k and self.max_deferred_experts_per_token >= top_k:
            raise error_for(
                "KT_MAX_DEFERRED_EXPERTS_PER_TOKEN",
                str(self.max_deferred_experts_per_token),
                f"the model routes each token to {top_k} experts",
            )

    def resolve_chunked_prefill_size(self, max_num_batched_tokens: int) -> int:
        """kt-kernel's C++ output buffer holds ``chunked_prefill_size`` tokens; a larger
        vLLM batch would overrun it, so the chunk must cover vLLM's token budget."""
        if self.chunked_prefill_size is None:
            return max_num_batched_tokens
        if self.chunked_prefill_size < max_num_batched_tokens:
            raise error_for(
                "KT_CHUNKED_PREFILL_SIZE",
                str(self.chunked_prefill_size),
                f"vLLM batches up to max_num_batched_tokens={max_num_batched_tokens} tokens; "
                "raise it or lower --max-num-batched-tokens",
            )
        return self.chunked_prefill_size

    def describe(self) -> str:
        gpu = "auto" if self.gpu_experts_auto else self.num_gpu_experts
        if self.gpu_experts_ratio is not None:
            gpu = f"ratio {self.gpu_experts_ratio:g}"
        return (
            f"backend={self.backend} method={self.method} gpu_experts={gpu} "
            f"placement={self.expert_placement} "
            f"threads={self.cpuinfer_threads} pools={self.threadpool_count} "
            f"weight_path={self.weight_path or '<model dir>'}" + (f" preset={self.preset}" if self.preset else "")
        )


def parse_positive_float(env: Mapping[str, str], name: str) -> float | None:
    value = _float(env, name, 0.0)
    if value == 0.0:
        raise error_for(name, env[name], "must be > 0")
    return value


def _placement(env: Mapping[str, str]) -> tuple[str, str | None]:
    """KT_EXPERT_PLACEMENT and its routing profile, the profile read and checked now."""
    from vllm_kt_plugin.placement import PLACEMENT_STRATEGIES
    from vllm_kt_plugin.routing_profile import load_routing_profile

    placement = (_str(env, "KT_EXPERT_PLACEMENT") or "uniform").lower()
    if placement not in PLACEMENT_STRATEGIES:
        raise error_for("KT_EXPERT_PLACEMENT", env["KT_EXPERT_PLACEMENT"], "unknown strategy")
    profile = _str(env, "KT_EXPERT_PROFILE")
    if placement == "frequency" and profile is None:
        raise error_for("KT_EXPERT_PLACEMENT", placement, "KT_EXPERT_PROFILE is unset")
    if profile is not None:
        profile = str(Path(profile).expanduser().resolve())
        load_routing_profile(profile)
    return placement, profile
