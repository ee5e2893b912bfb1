"""The split's cost model: which of a layer's picked CPU experts to stage in one forward,
and which path a forward of a given size takes (pure: no torch, no vLLM).

The CPU and the GPU work at once, the GPU's part after its copy over PCIe, so a layer
takes about max(write + copy + GPU(staged), write + CPU(rest), copy stream) + overhead,
the copy stream counting the prefetch too (it hides a copy's latency, not its time).
The best staged set is a prefix of "resident first, then most-picked first": ``plan``
scans them all. docs/split.md, "The cost model", derives it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from vllm_kt_plugin.hybrid.staging.plan import CPU_PATH, SPLIT_PATH, WHOLE_LAYER_PATH


@dataclass(frozen=True)
class SplitCosts:
    """Per-host constants of one layer shape and method, in seconds (``probe`` measures
    them at start-up)."""

    copy_s_per_expert: float  # one CPU expert's staged bytes over the host-to-GPU rate
    cpu_s_per_expert: float  # the CPU's fixed cost of an expert it computes (weight read)
    cpu_s_per_pick: float  # the CPU's cost of one token routed to one of its experts
    gpu_s_per_expert: float  # the GPU's fixed cost of a staged expert
    gpu_s_per_pick: float  # the GPU's cost of one token routed to a staged expert
    cpu_s_fixed: float = 0.0  # of a forward that leaves any expert to the CPU (submit, sync)
    gpu_s_fixed: float = 0.0  # of a forward that stages any expert (the shadow's launches)
    overhead_s: float = 0.0  # of a forward that stages anything (routing read-back, launches)
    # Layers without a host copy (kt-kernel's BF16 and FP8 write their experts out): the
    # write runs on kt-kernel's threads, so it delays both the copy and the CPU's own work.
    write_s_per_expert: float = 0.0
    split_over_model: float = 1.0  # SPLIT_OVER_MODEL of the staged format (not probed)

    def __post_init__(self) -> None:
        bad = {k: v for k, v in vars(self).items() if not v >= 0}  # also refuses NaN
        if bad:
            raise ValueError(f"split costs must be finite and >= 0: {bad}")

    def describe(self) -> str:
        us = 1e6
        return (
            f"copy {self.copy_s_per_expert * us:.0f} us/expert; CPU {self.cpu_s_fixed * us:.0f} us + "
            f"{self.cpu_s_per_expert * us:.1f} us/expert + {self.cpu_s_per_pick * us:.2f} us/pick; GPU "
            f"{self.gpu_s_fixed * us:.0f} us + {self.gpu_s_per_expert * us:.1f} us/expert + "
            f"{self.gpu_s_per_pick * us:.3f} us/pick; overhead {self.overhead_s * us:.0f} us"
            + (
                f"; written by the CPU backend {self.write_s_per_expert * us:.0f} us/expert"
                if self.write_s_per_expert
                else ""
            )
        )


@dataclass(frozen=True)
class SplitPlan:
    """What one forward of one layer does: ``staged`` (CPU-expert slots, the order they
    were chosen in) go to the GPU, the other picked ones to the CPU."""

    staged: tuple[int, ...]
    picked: int  # CPU experts this forward picked at all
    copied: int  # of the staged ones, those not resident: copied now
    predicted_s: float  # the model's layer time
    cpu_only_s: float  # the model's time of the CPU path (nothing staged)

    @property
    def is_split(self) -> bool:
        return 0 < len(self.staged) < self.picked


def order_for_staging(counts: Sequence[int], resident: Collection[int] = ()) -> list[int]:
    """Picked slots, resident ones first, each group most-picked first (ties: lower slot)."""
    picked = [s for s, c in enumerate(counts) if c > 0]
    return sorted(picked, key=lambda s: (s not in resident, -counts[s], s))


def cpu_time(costs: SplitCosts, experts: int, picks: float) -> float:
    """The CPU's time for ``experts`` experts with ``picks`` tokens routed to them."""
    return costs.cpu_s_fixed + experts * costs.cpu_s_per_expert + picks * costs.cpu_s_per_pick if experts else 0.0


def gpu_time(costs: SplitCosts, experts: int, picks: float) -> float:
    """The GPU's time for ``experts`` staged experts (their copies not counted)."""
    return costs.gpu_s_fixed + experts * costs.gpu_s_per_expert + picks * costs.gpu_s_per_pick if experts else 0.0


def _time(costs: SplitCosts, staged: int, prefetched: int, copied: int, gpu: float, cpu: float) -> float:
    """The layer's time with ``staged`` experts on the GPU, ``copied`` of them copied in
    now, ``prefetched`` rows copied in for it while the layer before ran (used or not:
    their copy ran), the GPU's and the CPU's work."""
    stream = (prefetched + copied) * costs.copy_s_per_expert  # the copy stream's share of a layer
    if not staged:  # the CPU path: the prefetch still ran, so every choice is bound alike
        return max(cpu, stream)
    write = copied * costs.write_s_per_expert
    return max(write + copied * costs.copy_s_per_expert + gpu, write + cpu, stream) + costs.overhead_s


def layer_time(
    costs: SplitCosts,
    counts: Sequence[int],
    staged: Sequence[int],
    resident: Collection[int],
    prefetched: int | None = None,
) -> float:
    """The model's time of one layer's CPU experts with ``staged`` on the GPU
    (``prefetched``: rows copied in for this forward, by default every resident one)."""
    on_gpu = set(staged)
    rest = [c for s, c in enumerate(counts) if c > 0 and s not in on_gpu]
    copied = sum(1 for s in on_gpu if s not in resident)
    gpu = gpu_time(costs, len(on_gpu), sum(counts[s] for s in on_gpu))
    fresh = len(resident) if prefetched is None else prefetched
    return _time(costs, len(on_gpu), fresh, copied, gpu, cpu_time(costs, len(rest), sum(rest)))


def plan(
    costs: SplitCosts, counts: Sequence[int], resident: Collection[int] = (), prefetched: int | None = None
) -> SplitPlan:
    """The staged set with the least modelled layer time among the prefixes of
    ``order_for_staging`` (ties: fewer staged). ``counts``: tokens routed to each CPU
    expert (by slot) in this forward; ``resident``: slots already on the GPU;
    ``prefetched``: rows copied in for this forward (by default every resident one; a
    buffer that kept its rows from an earlier forward copied fewer)."""
    order = order_for_staging(counts, resident)
    total_picks = sum(counts[s] for s in order)
    fresh = len(resident) if prefetched is None else prefetched
    cpu_only = _time(costs, 0, fresh, 0, 0.0, cpu_time(costs, len(order), total_picks))
    best_k, best_t = 0, cpu_only
    copied, staged_picks = 0, 0.0
    for k, slot in enumerate(order, start=1):  # layer_time of order[:k], incrementally
        copied += slot not in resident
        staged_picks += counts[slot]
        gpu = gpu_time(costs, k, staged_picks)
        t = _time(costs, k, fresh, copied, gpu, cpu_time(costs, len(order) - k, total_picks - staged_picks))
        if t < best_t:
            best_k, best_t = k, t
    staged = tuple(order[:best_k])
    copied = sum(1 for s in staged if s not in resident)
    return SplitPlan(staged, len(order), copied, best_t, cpu_only)


def share_plan(counts: Sequence[int], share: float, resident: Collection[int] = ()) -> SplitPlan:
    """KT_STAGING_SPLIT=<share>: stage that share of the picked CPU experts (rounded,
    resident and most-picked first), at least one and, where two or more were picked, at
    least one left to the CPU: a real split whenever one is possible (tests, measurements)."""
    order = order_for_staging(counts, resident)
    k = max(round(share * len(order)), 1) if order else 0
    if len(order) >= 2:
        k = min(k, len(order) - 1)
    staged = tuple(order[:k])
    return SplitPlan(staged, len(order), sum(1 for s in staged if s not in resident), float("nan"), float("nan"))


def fit_costs(points: Sequence[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Least-squares ``seconds = fixed + per_expert * experts + per_pick * picks`` through
    ``points`` of (experts, picks, seconds), which must tell the three apart (at least two
    expert counts and two pick counts); each clamped at 0: a probe's noise must not make
    a cost negative."""
    rows = [(1.0, float(e), float(p)) for e, p, _ in points]
    # The normal equations (A^T A) c = A^T y, solved by elimination with partial pivoting.
    ys = [y for *_, y in points]
    m = [
        [sum(r[i] * r[j] for r in rows) for j in range(3)] + [sum(r[i] * y for r, y in zip(rows, ys, strict=True))]
        for i in range(3)
    ]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12 * max(1.0, max(abs(v) for row in m for v in row[:3])):
            raise ValueError(f"fit_costs needs points that tell fixed, per-expert and per-pick apart: {points}")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(3):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col], strict=True)]
    fixed, per_expert, per_pick = (max(m[i][3] / m[i][i], 0.0) for i in range(3))
    return fixed, per_expert, per_pick


def balanced_count(costs: SplitCosts, counts: Sequence[int]) -> int:
    """How many experts the plan stages with nothing resident: the size of the part worth
    prefetching for the next layer (which has the same tokens)."""
    return len(plan(costs, counts).staged)


# The split's measured layer time over the model's prediction for its own plan, by staged
# format: ``forward_path`` scales the split's prediction by it, since the pure paths'
# predictions held and the split's did not. The largest measured ratio of each format
# (formats not measured take BF16's); docs/split.md, "Which path a forward takes", has the
# measurements and the open question behind them.
SPLIT_OVER_MODEL = {"bf16": 1.49, "block-fp8": 1.90}


def evenly_picked(tokens: int, num_cpu_experts: int, num_experts: int, top_k: int) -> list[float]:
    """Each CPU expert's tokens when a forward's picks spread evenly over the experts."""
    return [tokens * top_k / num_experts] * num_cpu_experts


def whole_layer_time(costs: SplitCosts, counts: Sequence[float]) -> float:
    """Every CPU expert staged with no routing read-back (the whole-layer stream): its copy ran
    while the layer before computed, so the layer takes the longer of the copy and the GPU's
    work; a layer without a host copy is written and copied on demand, one after the other."""
    m, picks = len(counts), sum(counts)
    gpu = gpu_time(costs, m, picks)
    if costs.write_s_per_expert:
        return m * (costs.write_s_per_expert + costs.copy_s_per_expert) + gpu
    return max(m * costs.copy_s_per_expert, gpu)


def forward_path(costs: SplitCosts, counts: Sequence[float]) -> str:
    """CPU_PATH, SPLIT_PATH or WHOLE_LAYER_PATH for a forward with these counts: the least
    predicted layer time, the split's scaled by ``costs.split_over_model``; the split as it
    runs layer after layer, with the balanced part prefetched (ties: the CPU path, then the
    whole layer)."""
    balanced = balanced_count(costs, counts)
    split = plan(costs, counts, set(range(balanced)), balanced)
    options = {
        CPU_PATH: cpu_time(costs, sum(1 for c in counts if c > 0), sum(counts)),
        WHOLE_LAYER_PATH: whole_layer_time(costs, counts),
    }
    if split.staged:
        options[SPLIT_PATH] = split.predicted_s * costs.split_over_model
    return min(options, key=lambda path: options[path])


def path_thresholds(
    costs: SplitCosts, num_cpu_experts: int, num_experts: int, top_k: int, limit: int
) -> tuple[int, int]:
    """(split_from, whole_from): the smallest forwards (tokens, up to ``limit``) that take the
    split and the whole-layer stream by ``forward_path`` when their picks spread evenly;
    ``limit + 1`` for a path never taken. Smaller forwards keep the CPU path, and skip the
    split's routing read-back. The paths follow one another as forwards grow (the CPU's work
    grows with them, the copy does not), so each threshold is found by bisection."""

    def path(tokens: int) -> str:
        return forward_path(costs, evenly_picked(tokens, num_cpu_experts, num_experts, top_k))

    def first(taken: Callable[[int], bool]) -> int:
        if num_cpu_experts == 0 or not taken(limit):
            return limit + 1
        low, high = 0, limit  # taken(high), not taken(low)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if taken(mid) else (mid, high)
        return high

    whole_from = first(lambda n: path(n) == WHOLE_LAYER_PATH)
    split_from = min(first(lambda n: path(n) != CPU_PATH), whole_from)
    return split_from, whole_from
