"""Placements (``planning/placement.py``): which experts of each layer go to the GPU
(KT_EXPERT_PLACEMENT), how many CPU expert evaluations each choice leaves on a profiled
workload, and the masks and slot routing a layer computes with."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from vllm_kt_plugin.planning.placement import (
    ExpertPlacement,
    count_cpu_evaluations,
    front_loading_counts,
    plan_placements,
    plan_placements_from_settings,
    route_to_gpu_slots,
)
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.loader import load_settings
from vllm_kt_plugin.settings.routing_profile import RoutingProfile, load_routing_profile, parse_routing_profile

MOE_LAYERS = (1, 2, 3, 4)  # layer 0 dense, as with first_k_dense_replace=1


def skewed_profile(num_experts: int = 8) -> RoutingProfile:
    """Each layer favours different experts, none of them among the first ones."""
    layers = {}
    for layer in MOE_LAYERS:
        counts = [1] * num_experts
        for rank, expert in enumerate((layer * 3 + k) % (num_experts - 2) + 2 for k in range(3)):
            counts[expert] = 1000 // (rank + 1)
        layers[layer] = tuple(counts)
    return RoutingProfile("skewed", num_experts, layers)


def test_uniform_is_the_first_n_of_every_layer() -> None:
    plan = plan_placements("uniform", MOE_LAYERS, 8, 3)
    assert set(plan) == set(MOE_LAYERS)
    assert all(p.gpu_expert_ids() == [0, 1, 2] for p in plan.values())


@pytest.mark.parametrize(
    "layers,experts,gpu",
    [(4, 8, 4), (10, 64, 10), (58, 256, 16), (3, 8, 7), (3, 4, 3), (5, 8, 8), (5, 8, 0), (7, 4, 1)],
)
def test_front_loading_keeps_the_total_and_favours_early_layers(layers: int, experts: int, gpu: int) -> None:
    counts = front_loading_counts(layers, experts, gpu)
    assert sum(counts) == layers * gpu
    assert all(0 <= c <= experts for c in counts)
    assert counts == sorted(counts, reverse=True)
    if 0 < gpu < experts:  # (3, 8, 7) and (3, 4, 3) fill the first layers to the top: [8, 8, 5], [4, 4, 1]
        assert counts[0] > gpu > counts[-1]


def test_front_loading_plan() -> None:
    plan = plan_placements("front-loading", MOE_LAYERS, 8, 4)
    assert [plan[i].num_gpu_experts for i in MOE_LAYERS] == [6, 5, 3, 2]
    assert plan[1].gpu_expert_ids() == [0, 1, 2, 3, 4, 5]


def test_random_is_seeded_and_differs_per_layer() -> None:
    plan = plan_placements("random", range(8), 64, 8, seed=7)
    again = plan_placements("random", range(8), 64, 8, seed=7)
    other = plan_placements("random", range(8), 64, 8, seed=8)
    masks = [plan[i].gpu_expert_ids() for i in range(8)]
    assert masks == [again[i].gpu_expert_ids() for i in range(8)]
    assert masks != [other[i].gpu_expert_ids() for i in range(8)]
    assert len({tuple(m) for m in masks}) > 1
    assert all(len(m) == 8 for m in masks)


def test_frequency_puts_the_most_used_experts_on_the_gpu() -> None:
    profile = skewed_profile()
    plan = plan_placements("frequency", MOE_LAYERS, 8, 3, profile=profile)
    for layer in MOE_LAYERS:
        counts = profile.counts(layer)
        top3 = sorted(sorted(range(8), key=lambda e: -counts[e])[:3])
        assert plan[layer].gpu_expert_ids() == top3


def test_frequency_leaves_fewer_cpu_evaluations_than_uniform() -> None:
    profile = skewed_profile()
    uniform = count_cpu_evaluations(profile, plan_placements("uniform", MOE_LAYERS, 8, 3))
    frequency = count_cpu_evaluations(profile, plan_placements("frequency", MOE_LAYERS, 8, 3, profile=profile))
    assert frequency < uniform
    assert frequency == 4 * 5  # only the five rarely-picked experts (1 pick each) stay on the CPU


def test_frequency_is_the_best_choice_of_that_many_experts() -> None:
    profile = skewed_profile(6)
    best = count_cpu_evaluations(profile, plan_placements("frequency", MOE_LAYERS, 6, 2, profile=profile))
    for gpu in itertools.combinations(range(6), 2):
        plan = {i: ExpertPlacement.from_gpu_expert_ids(6, list(gpu)) for i in MOE_LAYERS}
        assert count_cpu_evaluations(profile, plan) >= best


def test_cpu_evaluations_by_hand() -> None:
    profile = RoutingProfile("m", 4, {0: (5, 0, 2, 7), 1: (1, 1, 1, 1)})
    plan = {0: ExpertPlacement.from_gpu_expert_ids(4, [3]), 1: ExpertPlacement.first_n(4, 4)}
    assert count_cpu_evaluations(profile, plan) == 5 + 0 + 2


def test_frequency_needs_every_moe_layer_in_the_profile() -> None:
    with pytest.raises(KTConfigError, match="no counts for MoE layer 5"):
        plan_placements("frequency", (*MOE_LAYERS, 5), 8, 3, profile=skewed_profile())


def test_frequency_profile_of_another_model() -> None:
    with pytest.raises(KTConfigError, match="num_experts=8, but the model has 16"):
        plan_placements("frequency", MOE_LAYERS, 16, 3, profile=skewed_profile())


def write_profile(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return path


def test_profile_file_round_trip(tmp_path: Path) -> None:
    path = write_profile(tmp_path, {"model": "m", "num_experts": 3, "layers": {"1": [3, 0, 9], "2": [0, 0, 1]}})
    profile = load_routing_profile(str(path))
    assert (profile.model, profile.num_experts, dict(profile.layers)) == ("m", 3, {1: (3, 0, 9), 2: (0, 0, 1)})


BAD_PROFILES = [
    ("not an object", [1, 2], "<top level>", "list"),
    ("no num_experts", {"layers": {"0": [1]}}, "num_experts", "None"),
    ("zero experts", {"num_experts": 0, "layers": {"0": []}}, "num_experts", "0"),
    ("no layers", {"num_experts": 2}, "layers", "None"),
    ("layer key not an index", {"num_experts": 2, "layers": {"first": [1, 2]}}, "layers key", "first"),
    ("short count list", {"num_experts": 3, "layers": {"0": [1, 2]}}, "layers.0", "list of 2"),
    ("negative count", {"num_experts": 2, "layers": {"0": [1, -2]}}, "layers.0", "list of 2"),
    ("boolean count", {"num_experts": 2, "layers": {"0": [True, 2]}}, "layers.0", "list of 2"),
]


@pytest.mark.parametrize("data,key,value", [b[1:] for b in BAD_PROFILES], ids=[b[0] for b in BAD_PROFILES])
def test_bad_profile_is_one_clear_line(data: object, key: str, value: str) -> None:
    with pytest.raises(KTConfigError) as exc:
        parse_routing_profile(data, "p.json")
    message = str(exc.value)
    assert "\n" not in message and "KT_EXPERT_PROFILE='p.json'" in message, message
    assert key in message and value in message and "allowed" in message, message


def test_profile_that_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text("{layers: ")
    with pytest.raises(KTConfigError, match="not readable JSON") as exc:
        load_settings({"KT_EXPERT_PLACEMENT": "frequency", "KT_EXPERT_PROFILE": str(path)}, cores=4)
    assert "\n" not in str(exc.value)


def test_missing_profile_file() -> None:
    with pytest.raises(KTConfigError, match="KT_EXPERT_PROFILE='/no/such.json' is invalid"):
        load_settings({"KT_EXPERT_PROFILE": "/no/such.json"}, cores=4)


@pytest.mark.parametrize(
    "env,variable,value",
    [
        ({"KT_EXPERT_PLACEMENT": "frequency"}, "KT_EXPERT_PLACEMENT", "frequency"),
        ({"KT_EXPERT_PLACEMENT": "round-robin"}, "KT_EXPERT_PLACEMENT", "round-robin"),
        ({"KT_EXPERT_PLACEMENT_SEED": "-1"}, "KT_EXPERT_PLACEMENT_SEED", "-1"),
    ],
)
def test_placement_variable_mistakes(env: dict[str, str], variable: str, value: str) -> None:
    with pytest.raises(KTConfigError) as exc:
        load_settings(env, cores=4)
    message = str(exc.value)
    assert "\n" not in message and f"{variable}={value!r}" in message and "allowed" in message, message


def test_plan_from_settings(tmp_path: Path) -> None:
    profile = skewed_profile()
    data = {"model": "skewed", "num_experts": 8, "layers": {str(k): list(v) for k, v in profile.layers.items()}}
    path = write_profile(tmp_path, data)
    kt = load_settings({"KT_EXPERT_PLACEMENT": "Frequency", "KT_EXPERT_PROFILE": str(path)}, cores=4)
    plan = plan_placements_from_settings(kt, MOE_LAYERS, 8, 3)
    expected = plan_placements("frequency", MOE_LAYERS, 8, 3, profile=profile)
    assert {i: p.gpu_expert_ids() for i, p in plan.items()} == {i: p.gpu_expert_ids() for i, p in expected.items()}
    assert plan[1].gpu_expert_ids() != [0, 1, 2]


def test_route_to_gpu_slots() -> None:
    placement = ExpertPlacement.from_gpu_expert_ids(6, [0, 2, 5])
    ids = torch.tensor([[0, 1], [2, 5], [3, 4]], dtype=torch.int32)
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    slots, gpu_weights = route_to_gpu_slots(ids, weights, placement.gpu_slot_of())
    assert slots.dtype == torch.int32
    assert slots.tolist() == [[0, 0], [1, 2], [0, 0]]
    assert torch.equal(gpu_weights, torch.tensor([[0.6, 0.0], [0.7, 0.3], [0.0, 0.0]]))


def test_placement_masks() -> None:
    p = ExpertPlacement.first_n(8, 3)
    assert p.gpu_mask.tolist() == [True] * 3 + [False] * 5
    assert (p.num_gpu_experts, p.num_cpu_experts, p.cpu_expert_ids()) == (3, 5, [3, 4, 5, 6, 7])
    assert p.gpu_slot_of().tolist() == [0, 1, 2, -1, -1, -1, -1, -1]
    q = ExpertPlacement.from_gpu_expert_ids(8, [7, 2])
    assert q.gpu_slot_of().tolist() == [-1, -1, 0, -1, -1, -1, -1, 1]
    assert q.describe() == "2 GPU experts [2, 7], 6 CPU experts"
    with pytest.raises(ValueError):
        ExpertPlacement.first_n(8, 9)
