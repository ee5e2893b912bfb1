"""The bench's worker extension inside a ``vllm serve`` it starts (``--server-engine``).

``routing.server_recording()`` names ``BenchWorkerExtension`` as vLLM's
``--worker-extension-cls``. vLLM's worker imports this module when it starts, before it
builds the model, and that is when the routing recorder must attach to the MoE routers: so
importing this module installs it. ``/collective_rpc`` takes only a method's name (and
string arguments), so the extension gives the worker one method per thing the bench reads
there: the recorder's sums, kt-hybrid's per-forward timeline and split probe
and its decode timeline (``bench/timeline.py``)."""

from __future__ import annotations

from typing import Any

from vllm_kt_tools.bench import routing, timeline

routing.install()


class BenchWorkerExtension:
    """Mixed into vLLM's worker class; ``routing.SERVER_RPC`` and ``timeline.*_RPC`` name its methods."""

    def kt_bench_routing(self) -> dict[str, Any]:
        return routing.collect()

    def kt_bench_timeline_enable(self, label: str, min_tokens: str) -> None:
        timeline.enable_in_worker(self, label, min_tokens)

    def kt_bench_timeline_collect(self) -> list[dict[str, Any]]:
        return timeline.collect_in_worker(self)

    def kt_bench_split_costs(self) -> dict[str, Any] | None:
        return timeline.split_costs_in_worker(self)

    def kt_bench_decode_timeline_collect(self) -> list[dict[str, Any]]:
        return timeline.decode_collect_in_worker(self)
