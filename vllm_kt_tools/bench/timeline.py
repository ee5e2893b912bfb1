"""kt-hybrid's per-forward timeline in a bench run (``vllm_kt_plugin.hybrid.timeline``): each
prefill-sized forward of the engine workload, layer by layer, with vLLM's steps as it cut
them, and a summary per step that names where the time went.

The runtime records nothing unless asked. The bench asks before each prefill measurement,
with that measurement's name as the label (``enable``), and reads everything back after the
last (``collect``): through ``LLM.collective_rpc`` for an engine the bench built, through
vLLM's dev-mode ``/collective_rpc`` and the bench's worker extension (``server_worker``) for
a ``vllm serve`` it started. Only kt-hybrid runs have one.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from typing import Any

# Forwards of at least this many tokens are recorded (the runtime's large-forward log uses the
# same size); a workload with smaller prompts (the tests' tiny models) records from its own.
MIN_TOKENS = 256
ENABLE_RPC, COLLECT_RPC = "kt_bench_timeline_enable", "kt_bench_timeline_collect"
SPLIT_COSTS_RPC = "kt_bench_split_costs"
DECODE_COLLECT_RPC = "kt_bench_decode_timeline_collect"  # the decode timeline: bench/decode_timeline.py


def enable_in_worker(worker: Any = None, label: str = "", min_tokens: int | str = MIN_TOKENS) -> None:
    """Record the worker's forwards of ``min_tokens`` or more under ``label`` from now on."""
    from vllm_kt_plugin.hybrid.process_state import process_state

    process_state().timeline.enable(label, int(min_tokens))


def collect_in_worker(worker: Any = None) -> list[dict[str, Any]]:
    """The worker's recorded steps, and recording off."""
    from vllm_kt_plugin.hybrid.process_state import process_state

    timeline = process_state().timeline
    timeline.disable()
    return timeline.collect()


def decode_collect_in_worker(worker: Any = None) -> list[dict[str, Any]]:
    """The worker's decode steps since the last read (``hybrid.decode_timeline.step_rows``)."""
    from vllm_kt_plugin.hybrid.process_state import process_state

    return process_state().decode_timeline.collect()


def split_costs_in_worker(worker: Any = None) -> dict[str, Any] | None:
    """The split's start-up probe (``hybrid.staging.probe``) in the worker, as its log line gives
    it (seconds; the probed layer's expert bytes): what replays the timeline's split forwards
    against the cost model. None where no forward took the split."""
    from vllm_kt_plugin.hybrid.process_state import process_state

    probe = process_state().split_probe
    if probe is None:
        return None
    costs = dataclasses.asdict(probe.costs)
    del costs["split_over_model"]  # a layer's, by its staged format (staging.costs.SPLIT_OVER_MODEL)
    return {"expert_nbytes": probe.expert_nbytes, **costs}


class EngineTimeline:
    """The timeline of an engine the bench built (``vllm.LLM``)."""

    def __init__(self, llm: Any, min_tokens: int) -> None:
        self.llm, self.min_tokens = llm, min_tokens

    def mark(self, label: str) -> None:
        self.llm.collective_rpc(enable_in_worker, args=(label, self.min_tokens))

    def collect(self) -> list[dict[str, Any]]:
        return list(self.llm.collective_rpc(collect_in_worker)[0])

    def split_costs(self) -> dict[str, Any] | None:
        return self.llm.collective_rpc(split_costs_in_worker)[0]

    def collect_decode(self) -> list[dict[str, Any]]:
        return list(self.llm.collective_rpc(decode_collect_in_worker)[0])


class ServerTimeline:
    """The timeline of a ``vllm serve`` the bench started with its worker extension."""

    def __init__(self, base_url: str, min_tokens: int, timeout_s: float = 120.0) -> None:
        self.base_url, self.min_tokens, self.timeout_s = base_url, min_tokens, timeout_s

    def _rpc(self, method: str, *args: str) -> Any:
        request = urllib.request.Request(
            f"{self.base_url}/collective_rpc",
            data=json.dumps({"method": method, "args": list(args)}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return json.loads(response.read())["results"][0]

    def mark(self, label: str) -> None:
        self._rpc(ENABLE_RPC, label, str(self.min_tokens))

    def collect(self) -> list[dict[str, Any]]:
        return list(self._rpc(COLLECT_RPC))

    def split_costs(self) -> dict[str, Any] | None:
        return self._rpc(SPLIT_COSTS_RPC)

    def collect_decode(self) -> list[dict[str, Any]]:
        return list(self._rpc(DECODE_COLLECT_RPC))


class NoTimeline:
    """Runs without kt-hybrid: nothing to record."""

    def mark(self, label: str) -> None:
        pass

    def collect(self) -> list[dict[str, Any]]:
        return []

    def split_costs(self) -> dict[str, Any] | None:
        return None

    def collect_decode(self) -> list[dict[str, Any]]:
        return []


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Milliseconds covered by at least one interval."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarize(step: dict[str, Any]) -> dict[str, Any]:
    """One step in a line's worth of figures (milliseconds): its span from the first layer's
    start to the last layer's result; the routed experts' share of it (start to synced, summed
    over layers) and the rest (attention, norms, host stalls); the GPU, wait and copy sums;
    how long the copy stream was busy (the copy's own bound for this forward: copies in
    this step, the next step's first layer's prefetch included); the paths the layers took."""
    layers = step["layers"]
    moe = sum(layer["cpu_ms"] for layer in layers)  # start -> synced: the routed experts' time
    paths: dict[str, int] = {}
    for layer in layers:
        paths[layer["path"]] = paths.get(layer["path"], 0) + 1
    copy_busy = _union_ms([(c["start_ms"], c["start_ms"] + c["ms"]) for c in step["copies"]])
    staged = [layer for layer in layers if "staged" in layer]
    summary = {
        "label": step["label"],
        "tokens": step["tokens"],
        "layers": len(layers),
        "paths": paths,
        "span_ms": step["span_ms"],
        "moe_ms": round(moe, 3),
        "rest_ms": round(step["span_ms"] - moe, 3),
        "gpu_ms": round(sum(layer["gpu_ms"] for layer in layers), 3),
        "wait_ms": round(sum(layer["wait_ms"] for layer in layers), 3),
        "copy_ms": round(sum(c["ms"] for c in step["copies"]), 3),
        "copy_busy_ms": round(copy_busy, 3),
        "host_ms": step["host_ms"],
    }
    if staged:
        summary["staged_per_layer"] = round(sum(layer["staged"] for layer in staged) / len(staged), 1)
        summary["picked_per_layer"] = round(sum(layer["picked"] for layer in staged) / len(staged), 1)
    return summary


def timeline_record(steps: list[dict[str, Any]], split_costs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON's ``timeline``: the steps as recorded, their summaries, and the split's probe."""
    record = {"min_tokens": MIN_TOKENS, "steps": steps, "summary": [summarize(step) for step in steps]}
    return record if split_costs is None else {**record, "split_costs": split_costs}


def describe(summary: dict[str, Any]) -> str:
    """A step's summary for the bench's log."""
    paths = ", ".join(f"{n} {p}" for p, n in summary["paths"].items())
    return (
        f"{summary['label']}: a step of {summary['tokens']} tokens, {summary['span_ms']:.1f} ms ({paths}): routed "
        f"experts {summary['moe_ms']:.1f} (GPU {summary['gpu_ms']:.1f}, waiting on the CPU {summary['wait_ms']:.1f}), "
        f"the rest {summary['rest_ms']:.1f}; copies {summary['copy_ms']:.1f}, copy stream busy "
        f"{summary['copy_busy_ms']:.1f}; host {summary['host_ms']:.1f}"
    )
