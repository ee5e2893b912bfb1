"""The split's cost model (``hybrid/staging/costs.py``, pure): which picked CPU experts a
forward stages on the GPU, and which path a forward takes, replayed on the H100 curve and the
2026-12-06 sitting's timeline."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from vllm_kt_plugin.hybrid.staging.costs import (
    SPLIT_OVER_MODEL,
    SplitCosts,
    balanced_count,
    cpu_time,
    evenly_picked,
    fit_costs,
    forward_path,
    gpu_time,
    layer_time,
    order_for_staging,
    path_thresholds,
    plan,
    share_plan,
    whole_layer_time,
)
from vllm_kt_plugin.hybrid.staging.plan import CPU_PATH, SPLIT_PATH, WHOLE_LAYER_PATH

# Shaped like the committed H200 layer timeline of Qwen3-30B-A3B (AMXINT4, 95 CPU experts of
# 128, top-8): the whole layer's copy 16.2 ms -> 0.17 ms an expert; the CPU path 10.9 ms at
# 1,024 tokens and 20.1 ms at 2,048 (~5.8K CPU picks at 1,024) -> ~1.6 us a pick, ~15 us an
# expert. Only the shape matters here; the engine probes its own.
H200_LIKE = SplitCosts(
    copy_s_per_expert=16.2e-3 / 95,
    cpu_s_per_expert=15e-6,
    cpu_s_per_pick=1.6e-6,
    gpu_s_per_expert=5e-6,
    gpu_s_per_pick=0.01e-6,
    overhead_s=100e-6,  # the routing read-back and launches
)


def uniform(tokens: int, experts: int = 95, top_k: int = 8, total: int = 128) -> list[int]:
    return [round(tokens * top_k / total)] * experts


def test_order_puts_resident_then_most_picked_first() -> None:
    counts = [3, 0, 9, 9, 1]
    assert order_for_staging(counts) == [2, 3, 0, 4]  # unpicked 1 left out; ties by slot
    assert order_for_staging(counts, resident={4, 1}) == [4, 2, 3, 0]


def test_plan_is_the_best_prefix_and_beats_both_pure_paths() -> None:
    counts = [40 + 3 * s for s in range(95)]
    chosen = plan(H200_LIKE, counts)
    whole = layer_time(H200_LIKE, counts, [s for s, c in enumerate(counts) if c], ())
    assert chosen.is_split, chosen
    assert chosen.predicted_s < min(chosen.cpu_only_s, whole)
    assert chosen.predicted_s == pytest.approx(layer_time(H200_LIKE, counts, chosen.staged, ()))
    order = order_for_staging(counts)
    for k in range(len(order) + 1):  # no other prefix is faster
        assert layer_time(H200_LIKE, counts, order[:k], ()) >= chosen.predicted_s - 1e-12
    assert list(chosen.staged) == order[: len(chosen.staged)]  # most-picked first


def test_small_forwards_stage_nothing_large_ones_stage_almost_everything() -> None:
    assert plan(H200_LIKE, [1] * 8 + [0] * 87).staged == ()  # one token: its 8 experts stay on the CPU
    assert len(plan(H200_LIKE, uniform(64)).staged) < 0.2 * 95
    large = plan(H200_LIKE, uniform(16384))
    assert len(large.staged) >= 0.9 * large.picked


def test_staged_share_grows_with_the_forward() -> None:
    shares = [len(plan(H200_LIKE, uniform(n)).staged) for n in (256, 1024, 2048, 8192)]
    assert shares == sorted(shares) and shares[-1] > shares[0]


def test_resident_experts_cost_no_copy_and_come_first() -> None:
    counts = uniform(1024)
    cold = plan(H200_LIKE, counts)
    warm = plan(H200_LIKE, counts, resident=set(range(30)))
    assert set(range(30)) <= set(warm.staged) and warm.copied == len(warm.staged) - 30
    assert warm.predicted_s < cold.predicted_s


def test_prefetched_experts_still_take_the_copy_stream_time() -> None:
    """A prefetch hides a copy's latency, not its time: layer after layer the copy stream
    carries every prefetched expert, so a layer is no faster than its share of the stream."""
    counts = uniform(2048)
    resident = set(range(80))  # a prefetch far larger than the balanced part
    warm = plan(H200_LIKE, counts, resident)
    stream = (len(resident) + warm.copied) * H200_LIKE.copy_s_per_expert
    assert warm.predicted_s >= stream + H200_LIKE.overhead_s - 1e-12
    assert warm.predicted_s > plan(H200_LIKE, counts, set(range(balanced_count(H200_LIKE, counts)))).predicted_s
    # the prefetch ran whatever the plan: the CPU path is bound by it too, where it is longer
    small = uniform(256)
    assert cpu_time(H200_LIKE, 95, sum(small)) < len(resident) * H200_LIKE.copy_s_per_expert
    assert plan(H200_LIKE, small, resident).cpu_only_s == pytest.approx(len(resident) * H200_LIKE.copy_s_per_expert)
    # rows a buffer kept from an earlier forward were not copied for this one: no bound
    kept = plan(H200_LIKE, counts, set(range(95)), prefetched=0)
    assert kept.copied == 0 and kept.predicted_s < len(kept.staged) * H200_LIKE.copy_s_per_expert


# The split's per-layer time over the model's time for what ran, at each size of the H100
# curve (AMXINT4, 95 CPU experts, four layers, near-uniform routing), with the probed
# constants the JSON stored: 1.02-1.22 with the BF16 copy, 0.94-1.49 with the FP8 copy
# (the model leaves out something there, docs/split.md); before the copy stream's bound the
# model gave 1.8-4.2 (BF16) and 2.2-5.5 (FP8). Bounds: each measured range with 0.05 (low)
# and 0.1 (high).
CURVE = Path(__file__).parents[4] / "benchmarks/results/h100_split_curve_qwen3_30b_a3b.json"
MEASURED_OVER_MODEL = {"bf16": (1.02 - 0.05, 1.22 + 0.1), "fp8": (0.94 - 0.05, 1.49 + 0.1)}


@pytest.mark.parametrize("copy", ["bf16", "fp8"])
def test_model_accounts_for_the_measured_split_curve(copy: str) -> None:
    curve = json.loads(CURVE.read_text())["split_curve"]
    costs = SplitCosts(**curve["cost_model" if copy == "bf16" else "fp8_cost_model"])
    split = "split" if copy == "bf16" else "split_fp8"
    for tokens, row in curve["tokens"].items():
        counts = uniform(int(tokens), curve["cpu_experts_per_layer"])
        # each layer found the part its previous forward balanced prefetched (same routing)
        resident = set(range(balanced_count(costs, counts)))
        ran = range(round(row[f"{split}_staged_per_layer"]))
        ratio = row[f"{split}_ms"] / (layer_time(costs, counts, ran, resident) * 1e3)
        low, high = MEASURED_OVER_MODEL[copy]
        assert low <= ratio <= high, (copy, tokens, round(ratio, 3))


def test_overhead_keeps_marginal_splits_on_the_cpu() -> None:
    counts = uniform(512)
    assert plan(H200_LIKE, counts).staged
    costly = SplitCosts(**{**vars(H200_LIKE), "overhead_s": 1.0})
    assert plan(costly, counts).staged == ()


def test_share_plan_always_splits_when_it_can() -> None:
    assert len(share_plan([5, 4, 3, 2], 0.5).staged) == 2
    assert share_plan([5, 4, 3, 2], 0.01).staged == (0,)  # at least one
    assert share_plan([5, 4, 3, 2], 0.99).staged == (0, 1, 2)  # one left to the CPU
    assert share_plan([0, 7, 0], 0.5).staged == (1,)  # one picked: nothing to split
    assert share_plan([1, 1, 1, 1], 0.5, resident={3}).staged == (3, 0)


def test_balanced_count_is_the_plan_size_without_residents() -> None:
    counts = uniform(2048)
    assert balanced_count(H200_LIKE, counts) == len(plan(H200_LIKE, counts).staged)


def test_path_thresholds_are_where_the_choice_changes() -> None:
    costs = SplitCosts(**{**vars(H200_LIKE), "overhead_s": 2e-3})
    split_from, whole_from = path_thresholds(costs, 95, 128, 8, 16384)
    assert 1 < split_from < whole_from <= 16384

    def path(tokens: int) -> str:
        return forward_path(costs, evenly_picked(tokens, 95, 128, 8))

    assert path(split_from - 1) == CPU_PATH and path(split_from) == SPLIT_PATH
    assert path(whole_from - 1) == SPLIT_PATH and path(whole_from) == WHOLE_LAYER_PATH
    never = SplitCosts(**{**vars(H200_LIKE), "copy_s_per_expert": 1.0})  # PCIe far slower than the CPU
    assert path_thresholds(never, 95, 128, 8, 4096) == (4097, 4097)


def test_the_whole_layer_takes_its_copy_or_its_gpu_work_written_layers_both() -> None:
    counts = evenly_picked(4096, 95, 128, 8)
    assert whole_layer_time(H200_LIKE, counts) == pytest.approx(95 * H200_LIKE.copy_s_per_expert)
    written = SplitCosts(**{**vars(H200_LIKE), "write_s_per_expert": 50e-6})
    gpu = gpu_time(written, 95, sum(counts))
    assert whole_layer_time(written, counts) == pytest.approx(95 * (50e-6 + written.copy_s_per_expert) + gpu)


# The best path at each size of the H100 curve, measured (the CPU path below 512 tokens, where
# the stream's column holds the CPU path: CUDA-graph sizes), against the choice from the probed
# constants the JSON stored. From 1,024 tokens the chosen path must be the fastest or within
# 5 % of it (measured: the fastest at every size, with either copy; with FP8's factor at 1.49,
# as before the head-to-head sitting, 1.044x at 1,024 tokens); below, the split's model is off
# most (1.6-2.0x with the FP8 copy), and vLLM replays CUDA graphs for those sizes anyway.
# Without SPLIT_OVER_MODEL (1.0) the choice took up to 1.255x (BF16 copy) and 1.403x (FP8
# copy) the fastest.
CHOICE_WITHIN = 1.05


@pytest.mark.parametrize("copy", ["bf16", "fp8"])
def test_path_choice_follows_the_measured_curve(copy: str) -> None:
    curve = json.loads(CURVE.read_text())["split_curve"]
    over = SPLIT_OVER_MODEL["bf16" if copy == "bf16" else "block-fp8"]
    costs = SplitCosts(**{**curve["cost_model" if copy == "bf16" else "fp8_cost_model"], "split_over_model": over})
    suffix = "" if copy == "bf16" else "_fp8"
    m = curve["cpu_experts_per_layer"]
    worst = 1.0
    for tokens, row in curve["tokens"].items():
        if int(tokens) < 1024:
            continue
        measured = {
            CPU_PATH: row["cpu_ms"],
            SPLIT_PATH: row[f"split{suffix}_ms"],
            WHOLE_LAYER_PATH: row[f"whole_layer{suffix}_ms"],
        }
        chosen = forward_path(costs, evenly_picked(int(tokens), m, 128, 8))
        worst = max(worst, measured[chosen] / min(measured.values()))
        assert measured[chosen] <= CHOICE_WITHIN * min(measured.values()), (copy, tokens, chosen, measured)
    print(f"{copy}: the chosen path took at most {worst:.3f}x the fastest")


# The head-to-head sitting of 2026-12-06 (H100, kt-hybrid AMXINT4 behind vllm serve, the FP8
# copy): every 1,024-token forward took the split, 58-59 of 95 CPU experts staged, and the
# forwards of 2,048-7,168 tokens the whole layer (the probe's threshold was 1,421). Its probe's
# log line is in h100_h2h_probe.log: that of the sitting's first kt-hybrid start, minutes before
# the start the JSON measured, same host and settings (that start's log was not copied out).
SITTING = CURVE.parent / "h100_h2h_server_qwen3_30b_a3b.json"
PROBE_LOG = CURVE.parent / "h100_h2h_probe.log"


def _logged_costs(line: str) -> SplitCosts:
    """The constants of a probe's log line (``SplitCosts.describe``)."""
    us = [float(v) * 1e-6 for v in re.findall(r"([\d.]+) us", line)]
    copy, cpu_fixed, cpu_expert, cpu_pick, gpu_fixed, gpu_expert, gpu_pick, overhead = us
    return SplitCosts(copy, cpu_expert, cpu_pick, gpu_expert, gpu_pick, cpu_fixed, gpu_fixed, overhead)


def test_the_sittings_split_forwards_set_the_fp8_factor_and_now_take_the_whole_layer() -> None:
    [line] = [x for x in PROBE_LOG.read_text().splitlines() if "split cost model probed" in x]
    costs = _logged_costs(line.split("):", 1)[1])
    assert costs.copy_s_per_expert == pytest.approx(86e-6) and costs.overhead_s == pytest.approx(102e-6)
    [run] = [r for r in json.loads(SITTING.read_text())["server_engine"]["runs"] if r["system"] == "kt-hybrid"]
    summary = run["timeline"]["summary"]
    counts = evenly_picked(1024, 95, 128, 8)
    resident = set(range(balanced_count(costs, counts)))
    splits = [s for s in summary if s["tokens"] == 1024]
    assert len(splits) == 4 and all(s["staged_per_layer"] < s["picked_per_layer"] for s in splits)
    ratios = [
        s["moe_ms"] / s["layers"] / (layer_time(costs, counts, range(round(s["staged_per_layer"])), resident) * 1e3)
        for s in splits
    ]
    assert max(ratios) <= SPLIT_OVER_MODEL["block-fp8"] < max(ratios) + 0.01, ratios  # the largest measured
    # The whole layer ran faster than every split forward, at larger sizes (copy-bound: its
    # time is the copy's, with more GPU work than at 1,024 tokens)...
    wholes = [s for s in summary if 2048 <= s["tokens"] <= 7168]
    assert wholes and max(w["moe_ms"] for w in wholes) < min(s["moe_ms"] for s in splits)
    # ... and the factor now chooses it at 1,024 tokens, where the factor before chose the split.
    fp8 = SplitCosts(**{**vars(costs), "split_over_model": SPLIT_OVER_MODEL["block-fp8"]})
    assert forward_path(fp8, counts) == WHOLE_LAYER_PATH
    assert forward_path(SplitCosts(**{**vars(costs), "split_over_model": 1.49}), counts) == SPLIT_PATH


def test_fit_costs_tells_fixed_expert_and_pick_apart() -> None:
    truth = (300e-6, 15e-6, 1.6e-6)

    def seconds(experts: int, picks: int) -> float:
        return truth[0] + experts * truth[1] + picks * truth[2]

    points = [(95, 96, seconds(95, 96)), (95, 768, seconds(95, 768)), (23, 96, seconds(23, 96))]
    assert fit_costs(points) == pytest.approx(truth)
    assert fit_costs([(4, 8, 1.0), (4, 16, 0.5), (2, 8, 1.0)])[2] == 0.0  # a falling probe: no negative cost
    with pytest.raises(ValueError, match="tell fixed"):
        fit_costs([(4, 8, 1.0), (4, 16, 2.0)])  # one expert count: per-expert and fixed inseparable


def test_fixed_costs_favour_one_side() -> None:
    """A forward's fixed CPU cost is saved only by staging every picked expert; a fixed GPU
    cost is paid by staging any."""
    counts = uniform(2048)
    base = plan(H200_LIKE, counts)
    cpu_fixed = plan(SplitCosts(**{**vars(H200_LIKE), "cpu_s_fixed": 1.0}), counts)
    assert len(cpu_fixed.staged) == cpu_fixed.picked  # everything: no CPU forward at all
    gpu_fixed = plan(SplitCosts(**{**vars(H200_LIKE), "gpu_s_fixed": 1.0}), counts)
    assert gpu_fixed.staged == () and base.staged


def test_costs_refuse_negative_and_nan() -> None:
    with pytest.raises(ValueError, match="finite and >= 0"):
        SplitCosts(-1.0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="finite and >= 0"):
        SplitCosts(math.nan, 0, 0, 0, 0)


def test_a_written_layer_pays_its_write_on_both_sides() -> None:
    """Without a host copy kt-kernel's threads write the staged experts before they compute
    the rest: the write delays both sides, so fewer experts are worth staging."""
    counts = uniform(2048)
    written = SplitCosts(**{**vars(H200_LIKE), "write_s_per_expert": 100e-6})
    chosen = plan(written, counts)
    assert len(chosen.staged) < len(plan(H200_LIKE, counts).staged)
    k = len(chosen.staged)
    assert chosen.predicted_s == pytest.approx(layer_time(written, counts, chosen.staged, ()))
    assert layer_time(written, counts, chosen.staged, ()) > layer_time(H200_LIKE, counts, chosen.staged, ()) + 0.99 * (
        k * 100e-6
    )
