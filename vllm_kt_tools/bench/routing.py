"""The bench's workload routing: how the tokens it decodes pick experts, and a count of
what they picked.

Every workload samples at temperature 1 with the engine's seed (0): on dummy weights greedy
decoding routes a whole batch like one token, while sampling from the near-flat logits routes
like independent tokens. ``install()`` counts, per recorded MoE layer, the distinct experts of
each decode forward through vLLM's router ``capture_fn`` and a custom op; ``collect`` reads
the sums back. Why and how, in full: docs/benchmarks.md, "Routing, recorded".
"""

from __future__ import annotations

import os
from typing import Any

# decode batch sizes whose forwards are counted (the bench's decode_bs1 / decode_bs16)
COUNTED_TOKENS = (1, 16)
# record every n-th MoE layer (by creation order); env override for small test models
EVERY_VARIABLE = "VLLM_KT_BENCH_ROUTING_EVERY"
DEFAULT_EVERY = 16
# |measured - expected| / expected within this: the workload routes like independent tokens
TOLERANCE = 0.10

# Workload sampling, for every system (engine runs, the OpenAI client, `vllm bench serve`).
TEMPERATURE = 1.0


def expected_distinct(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts that ``tokens`` independent tokens pick, each ``top_k`` of
    ``num_experts`` uniformly: E * (1 - (1 - k/E)^B) (one expert is missed by one token
    with probability 1 - k/E)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def routing_summary(counts: dict[str, Any] | None, num_experts: int, top_k: int) -> dict[str, Any]:
    """The JSON's ``routing``: per counted batch size, measured distinct experts per
    recorded MoE layer per step, the independent-token figure and whether they agree
    within TOLERANCE; ``measured`` None where no forward of that size was seen."""
    out: dict[str, Any] = {"num_experts": num_experts, "top_k": top_k, "tolerance": TOLERANCE}
    if not counts or not counts.get("layers"):
        out["error"] = (counts or {}).get("error", "no MoE router was recorded (spawned engine, or monolithic kernel)")
        return out
    out["recorded_layers"] = counts["layers"]
    for tokens in COUNTED_TOKENS:
        forwards = counts["forwards"].get(str(tokens), 0)
        expected = expected_distinct(num_experts, top_k, tokens)
        measured = counts["distinct"].get(str(tokens), 0) / forwards if forwards else None
        out[f"bs{tokens}"] = {
            "measured_distinct_per_layer_step": round(measured, 2) if measured is not None else None,
            "expected_independent": round(expected, 2),
            "layer_forwards": forwards,
            "within_tolerance": (abs(measured - expected) / expected <= TOLERANCE) if measured is not None else None,
        }
    return out


class _Recorder:
    """Per recorded router: device counters of distinct experts and forwards, per counted
    batch size. Filled inside the forward (no host sync), read by ``snapshot``."""

    def __init__(self) -> None:
        self.routers: list[Any] = []  # (distinct [len(COUNTED_TOKENS)], forwards [same]) per recorded layer
        self.created = 0

    def attach(self, router: Any) -> None:
        import torch

        ordinal = self.created
        self.created += 1
        every = int(os.environ.get(EVERY_VARIABLE, DEFAULT_EVERY))
        if ordinal % every:
            return
        # allocated now, on the model's device (vLLM builds the model under that device), so
        # that nothing is allocated inside a CUDA graph capture
        counters = torch.zeros(2, len(COUNTED_TOKENS), dtype=torch.int64)
        num_experts = int(router.global_num_experts)
        self.routers.append(counters)
        count = _count_op()  # defined now, not inside the traced forward

        def capture(topk_ids: torch.Tensor) -> None:
            count(topk_ids, counters, num_experts)

        router.set_capture_fn(capture)

    def snapshot(self) -> dict[str, Any]:
        if not self.routers:
            return {"layers": 0, "error": "no MoE router was created in this process"}
        import torch

        total = torch.stack([c.cpu() for c in self.routers]).sum(0)
        return {
            "layers": len(self.routers),
            "distinct": {str(t): int(total[0, i]) for i, t in enumerate(COUNTED_TOKENS)},
            "forwards": {str(t): int(total[1, i]) for i, t in enumerate(COUNTED_TOKENS)},
        }


_RECORDER = _Recorder()
_OP: Any = None


def _count_op() -> Any:
    """``count(topk_ids, counters, num_experts)`` as a custom op: opaque to torch.compile
    (vLLM's CPU build traces the MoE layer, and the batch size is dynamic there; on CUDA the
    MoE layer is an opaque op already, and its kernels go into the CUDA graphs)."""
    global _OP
    if _OP is None:
        import torch

        # schema spelled out: this module's annotations are strings (``from __future__``)
        @torch.library.custom_op(
            "vllm_kt_bench::count_routed",
            mutates_args=("counters",),
            schema="(Tensor topk_ids, Tensor(a!) counters, int num_experts) -> ()",
        )
        def count(topk_ids, counters, num_experts):  # type: ignore[no-untyped-def]
            tokens = int(topk_ids.shape[0])
            if tokens not in COUNTED_TOKENS:
                return
            slot = COUNTED_TOKENS.index(tokens)
            seen = torch.zeros(num_experts, dtype=torch.int64, device=topk_ids.device)
            seen.index_fill_(0, topk_ids.reshape(-1).long(), 1)
            counters[0, slot] += seen.sum()
            counters[1, slot] += 1

        @count.register_fake
        def _(topk_ids, counters, num_experts):  # type: ignore[no-untyped-def]
            return None

        _OP = count
    return _OP


def install() -> None:
    """Attach the recorder to every vLLM MoE router created from now on in this process
    and in the engine processes it forks (call before the engine starts; spawned ones
    call it themselves through ``child_env``)."""
    from vllm_kt_tools.support.vllm_internals import moe_router_class

    BaseRouter = moe_router_class()  # noqa: N806 (vLLM's class)
    if getattr(BaseRouter.__init__, "_kt_bench_routing", False):
        return
    original = BaseRouter.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _RECORDER.attach(self)

    __init__._kt_bench_routing = True  # type: ignore[attr-defined]
    BaseRouter.__init__ = __init__  # type: ignore[method-assign]
    # collect() goes to the engine process as a pickled function
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"


PRELOAD = f"{__name__}:install"


def child_env() -> dict[str, str]:
    """Environment for a bench child: the recorder installed in it and in every process
    vLLM forks or spawns from it (``support.child``'s preload)."""
    from vllm_kt_tools.support.child import PRELOAD_VARIABLE

    return {PRELOAD_VARIABLE: PRELOAD, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


SERVER_RPC = "kt_bench_routing"  # the worker method bench/server_worker.py adds


def server_recording() -> tuple[dict[str, str], list[str]]:
    """The environment and ``vllm serve`` flags of a server whose routing is recorded:
    vLLM's worker imports ``bench/server_worker.py`` (its ``--worker-extension-cls``) before
    it builds the model, which installs the recorder there, and the counts come back through
    vLLM's dev-mode ``/collective_rpc``. Nothing is installed in servers the bench did not start."""
    # VLLM_ALLOW_INSECURE_SERIALIZATION for the API server too: where the worker runs inside the
    # engine core (one GPU: vLLM's in-process executor), the recorder's install sets it there, the
    # engine core then sends utility results pickled, and an API server without it dies decoding
    # them ("must be set to use custom utility result types": the H100 sitting of 2026-12-06).
    return {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}, [
        "--worker-extension-cls",
        "vllm_kt_tools.bench.server_worker.BenchWorkerExtension",
    ]


def server_counts(base_url: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """The raw sums the server's worker recorded so far."""
    import json
    import urllib.request

    request = urllib.request.Request(
        f"{base_url}/collective_rpc",
        data=json.dumps({"method": SERVER_RPC}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return dict(json.loads(response.read())["results"][0])
    except Exception as exc:  # the figures stay; the JSON says the routing was not measured
        return {"error": f"/collective_rpc failed: {exc!r}"[-500:]}


def counted_routing(
    counts: dict[str, Any], num_experts: int, top_k: int, since: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``routing_summary`` of ``counts`` after ``since`` (an earlier reading: the engine's own
    warm-up and CUDA-graph capture run dummy batches)."""
    return routing_summary(_difference(counts, since or {}), num_experts, top_k)


def collect(worker: Any = None) -> dict[str, Any]:
    """The recorder's sums in this process (``LLM.collective_rpc(collect)`` runs it in the
    engine's worker)."""
    return _RECORDER.snapshot()


def engine_counts(llm: Any) -> dict[str, Any]:
    """The raw sums ``llm``'s worker recorded so far (its engine core is another process)."""
    try:
        return dict(llm.collective_rpc(collect)[0])
    except Exception as exc:  # the figures stay; the JSON says the routing was not measured
        return {"error": f"collective_rpc failed: {exc!r}"[-500:]}


def engine_routing(llm: Any, num_experts: int, top_k: int, since: dict[str, Any] | None = None) -> dict[str, Any]:
    """``routing_summary`` of what ``llm``'s worker recorded (after ``since``, an earlier
    ``engine_counts``: the engine's own warm-up and CUDA-graph capture run dummy batches)."""
    return counted_routing(engine_counts(llm), num_experts, top_k, since)


def _difference(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    if not after.get("layers"):
        return after
    return {
        "layers": after["layers"],
        **{
            key: {t: after[key][t] - before.get(key, {}).get(t, 0) for t in after[key]}
            for key in ("distinct", "forwards")
        },
    }
