"""KT_* variables parsed and checked: ``KTSettings.from_env``.

Each value is checked once, against the catalogue's rules, with one ``KTConfigError``
line per mistake, before any weight is loaded. Checks that need the model (number of
experts, top-k) or vLLM's scheduler budget run as soon as those are known, still before
weights; how a layer stages its CPU experts is checked by ``hybrid.staging.plan``.
Presets and the routing profile are composed on top by ``settings.loader``.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from vllm_kt_plugin.settings.catalogue import AUTO, BY_NAME, LOGGER_NAME, RESERVED_CORES, VARIABLES, Auto
from vllm_kt_plugin.settings.errors import KTConfigError

logger = logging.getLogger(LOGGER_NAME)


def check_cache_dir(path: str) -> str:
    """KT_CACHE_DIR ``path``, created now (the catalogue's parser), resolved."""
    return str(parse_variable({"KT_CACHE_DIR": path}, "KT_CACHE_DIR"))


@functools.cache
def process_cores() -> tuple[int, ...]:
    """The cores this process may run on (affinity and cgroup-pinned sets respected), as it
    started: KT_VLLM_CORES=free narrows the threads' affinity later."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return tuple(range(os.cpu_count() or 1))


def usable_cores() -> int:
    return len(process_cores())


def numa_node_count() -> int:
    nodes = glob.glob("/sys/devices/system/node/node[0-9]*")
    return max(1, len(nodes))


@dataclass(frozen=True)
class HostShare:
    """The kt-kernel processes of this host: tensor-parallel rank 0 of each pipeline stage
    computes its stage's CPU experts, so the stages that share a host share its cores and
    NUMA nodes. ``ranks``: how many run here; ``index``: this process's place among them."""

    ranks: int = 1
    index: int = 0

    def describe(self) -> str:
        return f"kt-kernel process {self.index + 1} of {self.ranks} on this host (one per pipeline stage)"


ALONE = HostShare()  # the one kt-kernel process of its host


def host_share(pipeline_size: int, tensor_size: int, nodes: int, pipeline_rank: int) -> HostShare:
    """vLLM numbers ranks stage by stage (rank = stage x TP size + TP rank) and gives each
    host a contiguous block of them; kt-kernel runs in each stage's first rank."""
    per_host = max(1, pipeline_size * tensor_size // max(1, nodes))

    def host_of(stage: int) -> int:
        return stage * tensor_size // per_host

    here = [stage for stage in range(pipeline_size) if host_of(stage) == host_of(pipeline_rank)]
    return HostShare(len(here), here.index(pipeline_rank))


def default_cpuinfer_threads(cores: int, share: HostShare = ALONE) -> int:
    """All cores minus two, divided among the host's kt-kernel processes: kt's spinning
    workers plus the Python and CUDA-callback threads oversubscribe a fully used CPU
    (13-26x slower measured on the H200 host)."""
    return max(1, (cores - RESERVED_CORES) // share.ranks)


def oversubscription(threads: int, cores: int, share: HostShare = ALONE) -> str | None:
    """Why ``threads`` kt-kernel threads in each of the host's kt-kernel processes, on
    ``cores`` usable cores, is slow, or None."""
    total = threads * share.ranks
    if total < cores:
        return None
    each = f" in each of the {share.ranks} pipeline stages on this host ({total} threads)" if share.ranks > 1 else ""
    return (
        f"KT_CPUINFER={threads}{each} uses all {cores} usable cores: kt-kernel's spinning workers then compete "
        f"with vLLM's own threads (13-26x slower measured); leave at least {RESERVED_CORES} cores free, "
        f"e.g. KT_CPUINFER={default_cpuinfer_threads(cores, share)}"
    )


def numa_nodes_for(pools: int, numa_nodes: int, share: HostShare) -> tuple[int, ...] | None:
    """The NUMA nodes of this process's thread pools when several kt-kernel processes share
    the host and each can have nodes of its own (else None: kt-kernel's 0, 1, ...)."""
    per_rank = numa_nodes // share.ranks
    if share.ranks == 1 or per_rank < pools:
        return None
    return tuple(range(share.index * per_rank, share.index * per_rank + pools))


def check_threadpool_count(pools: int, threads: int, numa_nodes: int) -> None:
    """One kt-kernel thread pool per NUMA node at most, each with at least one thread."""
    if pools > numa_nodes:
        raise KTConfigError("KT_THREADPOOL_COUNT", str(pools), f"this machine has {numa_nodes} NUMA node(s)")
    if pools > threads:
        raise KTConfigError("KT_THREADPOOL_COUNT", str(pools), f"only {threads} CPU thread(s) (KT_CPUINFER)")


_NOTICED: set[str] = set()  # former names whose notice this process gave


def _raw(env: Mapping[str, str], name: str) -> str | None:
    """The text of variable ``name`` in ``env``, or of a former name of it (saying once
    which name it has now); None where neither is set."""
    raw = env.get(name)
    for old in BY_NAME[name].old_names:
        given = env.get(old)
        if given is None or given.strip() == "":
            continue
        if raw is not None and raw.strip() != "" and raw.strip() != given.strip():
            raise KTConfigError(name, raw, f"its former name {old} is set too, to {given!r}", "one of the two")
        if old not in _NOTICED:
            _NOTICED.add(old)
            logger.warning("kt-hybrid: %s is now called %s; the old name still works", old, name)
        raw = given if raw is None or raw.strip() == "" else raw
    return raw


def parse_variable(env: Mapping[str, str], name: str) -> Any:
    """Variable ``name`` of ``env`` (or its former name) through its catalogue parser: its
    value, or the catalogue's value when unset (or empty); a bad value is one KTConfigError
    line."""
    variable = BY_NAME[name]
    raw = _raw(env, name)
    if raw is None or raw.strip() == "":
        return variable.unset_value()
    try:
        return variable.parse(raw.strip())
    except ValueError as exc:
        raise KTConfigError(name, raw, str(exc)) from None


def _unset(name: str) -> Any:
    """A KTSettings field's default: the catalogue's value of an unset variable."""
    value = BY_NAME[name].unset
    return field(default_factory=value) if callable(value) else value


@dataclass(frozen=True)
class KTSettings:
    """Validated KT_* settings. A variable set to ``auto`` is ``AUTO`` here, until what it
    decides is known (the method: when the backend is picked; the rest per model and layer);
    ``None`` means "unset: the default that depends on the model or on vLLM"."""

    backend: str = _unset("KT_BACKEND")
    method: str | Auto | None = _unset("KT_METHOD")
    auto_method: bool = False  # the method was picked by KT_METHOD=auto (for messages)
    weight_path: str | None = _unset("KT_WEIGHT_PATH")
    num_gpu_experts: int | Auto = _unset("KT_NUM_GPU_EXPERTS")  # AUTO: fit the GPU (planning)
    cpuinfer_threads: int = 1
    requested_threads: int | None = _unset("KT_CPUINFER")  # as given; None: divided from the usable cores
    threadpool_count: int = _unset("KT_THREADPOOL_COUNT")
    vllm_cores: str = _unset("KT_VLLM_CORES")
    chunked_prefill_size: int | None = _unset("KT_CHUNKED_PREFILL_SIZE")
    max_deferred_experts_per_token: int = _unset("KT_MAX_DEFERRED_EXPERTS_PER_TOKEN")
    cache_dir: str = _unset("KT_CACHE_DIR")
    gpu_experts_ratio: float | None = _unset("KT_GPU_EXPERTS_RATIO")
    kv_cache_reserve_gb: float | None = _unset("KT_KV_CACHE_RESERVE_GB")
    gpu_memory_gb: float | None = _unset("KT_GPU_MEMORY_GB")
    expert_placement: str = _unset("KT_EXPERT_PLACEMENT")
    expert_profile: str | None = _unset("KT_EXPERT_PROFILE")
    expert_placement_seed: int = _unset("KT_EXPERT_PLACEMENT_SEED")
    metrics_interval_s: float = _unset("KT_METRICS_INTERVAL")
    staging_min_tokens: int | Auto = _unset("KT_STAGING_MIN_TOKENS")  # 0: off
    staging_split: float | Auto = _unset("KT_STAGING_SPLIT")  # a share: the split forced
    staging_fp8_copy: bool | Auto = _unset("KT_STAGING_FP8_COPY")
    staging_gather_ms: float = _unset("KT_STAGING_GATHER_MS")  # kt-hybrid's scheduler's wait; 0: off
    dynamic_gpu_experts: int = _unset("KT_DYNAMIC_GPU_EXPERTS")  # every N-th forward outside graphs; 0: off
    host_share: HostShare = ALONE
    numa_nodes: tuple[int, ...] | None = None  # of this process's pools; None: kt-kernel's default
    preset: str | None = None  # the KT_CONFIG preset file applied, for the log
    given: tuple[tuple[str, str], ...] = ()  # the KT_* variables parsed, as set where vllm serve started

    @property
    def gpu_experts_auto(self) -> bool:
        return self.num_gpu_experts is AUTO

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        cores: int | None = None,
        numa_nodes: int | None = None,
        share: HostShare = ALONE,
    ) -> KTSettings:
        """Parse and check every KT_* variable that needs no model knowledge; ``share``:
        the host's kt-kernel processes, among which the default threads are divided."""
        env = os.environ if env is None else env
        values = {v.field: parse_variable(env, v.name) for v in VARIABLES if v.field is not None}
        if values["gpu_experts_ratio"] is not None and (env.get("KT_NUM_GPU_EXPERTS") or "").strip():
            raise KTConfigError(
                "KT_GPU_EXPERTS_RATIO", env["KT_GPU_EXPERTS_RATIO"], "KT_NUM_GPU_EXPERTS is set too; set only one"
            )
        if values["expert_placement"] == "frequency" and values["expert_profile"] is None:
            raise KTConfigError("KT_EXPERT_PLACEMENT", "frequency", "KT_EXPERT_PROFILE is unset")
        gather = (_raw(env, "KT_STAGING_GATHER_MS") or "").strip()
        if values["staging_min_tokens"] == 0 and values["staging_gather_ms"] and gather:
            raise KTConfigError(
                "KT_STAGING_GATHER_MS",
                gather,
                "KT_STAGING_MIN_TOKENS=0 turns staging off, so no forward streams the whole layer",
                "0 (or unset) with staging off",
            )
        return cls(**values)._shared(share, cores=cores, numa_nodes=numa_nodes)

    def for_host(self, share: HostShare, *, cores: int | None = None, numa_nodes: int | None = None) -> KTSettings:
        """These settings in one of this host's ``share.ranks`` kt-kernel processes: vLLM
        builds the config in its front end, before any rank exists and maybe on another
        host, so each worker sizes its threads and NUMA nodes again, on its own host."""
        here = self._shared(share, cores=cores, numa_nodes=numa_nodes, warn=False)
        if here == self:
            return self
        return self._shared(share, cores=cores, numa_nodes=numa_nodes)

    def _shared(self, share: HostShare, *, cores: int | None, numa_nodes: int | None, warn: bool = True) -> KTSettings:
        """Threads (KT_CPUINFER, or the default divided by ``share``) and NUMA nodes, checked."""
        cores = usable_cores() if cores is None else cores
        numa_nodes = numa_node_count() if numa_nodes is None else numa_nodes
        threads = self.requested_threads or default_cpuinfer_threads(cores, share)
        if warn and self.requested_threads and (warning := oversubscription(threads, cores, share)) is not None:
            logger.warning("kt-hybrid: %s", warning)
        check_threadpool_count(self.threadpool_count, threads, numa_nodes)
        return replace(
            self,
            cpuinfer_threads=threads,
            host_share=share,
            numa_nodes=numa_nodes_for(self.threadpool_count, numa_nodes, share),
        )

    def with_method(self, method: str, *, auto: bool = False) -> KTSettings:
        return replace(self, method=method, auto_method=auto or self.auto_method)

    def check_model(self, num_experts: int, top_k: int) -> None:
        """Checks that need the model's expert count and top-k (known from its config)."""
        if num_experts <= 0:
            raise KTConfigError(
                "--quantization",
                "kt-hybrid",
                "this model's config declares no routed experts",
                "a Mixture-of-Experts model",
            )
        if not self.gpu_experts_auto and self.num_gpu_experts > num_experts:  # type: ignore[operator]
            raise KTConfigError(
                "KT_NUM_GPU_EXPERTS",
                str(self.num_gpu_experts),
                f"the model has {num_experts} routed experts per layer",
            )
        if top_k and self.max_deferred_experts_per_token >= top_k:
            raise KTConfigError(
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
            raise KTConfigError(
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
        host = ""
        if self.host_share.ranks > 1:
            nodes = f"NUMA nodes {list(self.numa_nodes)}" if self.numa_nodes else "NUMA nodes shared"
            host = f" ({self.host_share.describe()}, {nodes})"
        return (
            f"backend={self.backend} method={self.method}{' (auto)' if self.auto_method else ''} gpu_experts={gpu} "
            f"placement={self.expert_placement} "
            f"threads={self.cpuinfer_threads}{host} pools={self.threadpool_count} "
            f"weight_path={self.weight_path or '<model dir>'}" + (f" preset={self.preset}" if self.preset else "")
        )
