"""kt-hybrid's scheduler (``hybrid/scheduler.py``) on vLLM's real schedulers, built without an
engine (``kt_testing.schedulers``), both of them: ``Scheduler`` (vLLM's CPU build, pipeline
parallelism) and ``AsyncScheduler`` (vLLM's default on a GPU). A held step is vLLM's own step
with no new request admitted; the step after the hold takes every prompt that waited. The
engine with ``vllm serve``: ``tests/engine/test_serving_e2e.py``."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kt_testing.schedulers import build_scheduler, request, scheduler_vllm_config

from vllm_kt_plugin.hybrid.admission import AdmissionGate
from vllm_kt_plugin.hybrid.scheduler import GATHERED
from vllm_kt_plugin.hybrid.vllm_compat import holding_scheduler_class
from vllm_kt_plugin.settings.catalogue import GATHERING_SCHEDULER, LOGGER_NAME

MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory) -> object:
    return scheduler_vllm_config(tmp_path_factory.mktemp("scheduler"), budget=2048, max_seqs=16)


@pytest.fixture
def plugin_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Our logger lives under vLLM's, which does not propagate to caplog's root logger."""
    plugin_logger = logging.getLogger(LOGGER_NAME)
    plugin_logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    yield caplog
    plugin_logger.removeHandler(caplog.handler)


class Clock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def scheduled(out: object) -> dict[str, int]:
    return dict(out.num_scheduled_tokens)  # type: ignore[attr-defined]


@MODES
def test_held_prompts_share_one_step(vllm_config, async_scheduling: bool) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.interface import PauseState

    scheduler = build_scheduler(holding_scheduler_class(async_scheduling), vllm_config)
    assert isinstance(scheduler, AsyncScheduler) == async_scheduling
    wall = Clock(1000.0)
    scheduler.kt_gate = AdmissionGate(0.05, 2048, 16, lambda: 64, wall=wall, clock=wall).holds
    scheduler.add_request(request("a", 100, arrival=1000.0))
    wall.now = 1000.01
    held = scheduler.schedule()
    assert held.total_num_scheduled_tokens == 0 and scheduler.pause_state == PauseState.UNPAUSED
    scheduler.update_from_output(held, _empty_output())  # as the engine core does with a step of none
    for name in ("b", "c"):
        scheduler.add_request(request(name, 100, arrival=wall.now))
        wall.now += 0.01
        assert scheduler.schedule().total_num_scheduled_tokens == 0
    wall.now = 1000.06  # the oldest's 50 ms are over
    assert scheduled(scheduler.schedule()) == {"a": 100, "b": 100, "c": 100}
    # Now requests run: a new prompt is never held (nor is any decode).
    scheduler.add_request(request("d", 100, arrival=wall.now))
    assert scheduled(scheduler.schedule())["d"] == 100


@MODES
def test_without_the_gate_the_first_prompt_goes_alone(vllm_config, async_scheduling: bool) -> None:
    """vLLM's own scheduling, what the gate changes (so the test above can fail)."""
    scheduler = build_scheduler(holding_scheduler_class(async_scheduling), vllm_config)
    scheduler.add_request(request("a", 100))
    assert scheduled(scheduler.schedule()) == {"a": 100}
    scheduler.add_request(request("b", 100))
    assert scheduled(scheduler.schedule())["b"] == 100


@MODES
def test_vllm_loads_the_class_by_name_and_gets_its_own_scheduler_with_the_gate(
    vllm_config, async_scheduling: bool, fresh_process_state: object, monkeypatch: pytest.MonkeyPatch, plugin_log
) -> None:
    """``--scheduler-cls`` as vLLM's engine core resolves it: the scheduler vLLM would pick for
    its mode, which holds a prompt that streams the whole layer (KT_STAGING_MIN_TOKENS=64:
    no layers live in this process, so the settings say) and logs the gather when it lets it go."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_kt_plugin.hybrid.quant_config import KTHybridConfig
    from vllm_kt_plugin.settings.loader import load_settings

    env = {"KT_BACKEND": "torch", "KT_STAGING_MIN_TOKENS": "64", "KT_STAGING_GATHER_MS": "1000"}
    monkeypatch.setattr(vllm_config, "quant_config", KTHybridConfig(settings=load_settings(env, cores=4)))
    monkeypatch.setattr(vllm_config.scheduler_config, "async_scheduling", async_scheduling)
    monkeypatch.setattr(vllm_config.scheduler_config, "scheduler_cls", GATHERING_SCHEDULER)
    scheduler = build_scheduler(vllm_config.scheduler_config.get_scheduler_cls(), vllm_config)
    assert isinstance(scheduler, Scheduler) and isinstance(scheduler, AsyncScheduler) == async_scheduling
    assert "held up to 1000 ms" in plugin_log.text and "streams from 64 tokens" in plugin_log.text
    scheduler.add_request(request("small", 63))  # below the whole layer: not held
    assert scheduled(scheduler.schedule()) == {"small": 63}

    scheduler = build_scheduler(vllm_config.scheduler_config.get_scheduler_cls(), vllm_config)
    scheduler.add_request(request("a", 100))
    assert scheduler.schedule().total_num_scheduled_tokens == 0  # held: it arrived just now
    scheduler.add_request(request("b", 100, arrival=time.time() - 1.5))  # the oldest waited 1.5 s
    assert scheduled(scheduler.schedule()) == {"a": 100, "b": 100}
    assert f"{GATHERED} 2 prompts (200 tokens) into one step" in plugin_log.text


def test_without_kt_hybrid_the_scheduler_is_vllms_own(vllm_config, plugin_log) -> None:
    from vllm_kt_plugin.hybrid.scheduler import KTHybridScheduler

    assert vllm_config.quant_config is None  # plain vLLM's model
    scheduler = build_scheduler(KTHybridScheduler, vllm_config)
    assert scheduler.kt_gate is None and "without --quantization kt-hybrid" in plugin_log.text
    scheduler.add_request(request("a", 100))
    assert scheduled(scheduler.schedule()) == {"a": 100}


@pytest.mark.parametrize(
    "env,want",
    [
        ({"KT_STAGING_MIN_TOKENS": "12"}, 12),  # every layer streams whole from 12 tokens
        ({"KT_STAGING_MIN_TOKENS": "12", "KT_STAGING_SPLIT": "0.5"}, None),  # a part, never whole
        ({}, None),  # auto without CUDA: no layer stages, whatever the settings alone would say
    ],
    ids=["whole layer", "forced split", "auto off"],
)
def test_the_layers_of_this_process_say_from_which_size_the_whole_layer_streams(
    vllm_layer_context, fresh_process_state, env: dict[str, str], want: int | None
) -> None:
    """One GPU: the layers live in the scheduler's process, and their paths say (real kt-hybrid
    layers, torch backend, staging forced on this CPU build as the engine tests force it)."""
    from vllm_kt_plugin.hybrid.admission import whole_layer_from
    from vllm_kt_plugin.hybrid.quant_config import KTHybridConfig
    from vllm_kt_plugin.hybrid.scheduler import layers_seen
    from vllm_kt_plugin.settings.loader import load_settings
    from vllm_kt_tools.support.moe_layers import build_moe, load, random_experts

    assert layers_seen(fresh_process_state) is None  # no layer here: the settings would say
    settings = load_settings({"KT_BACKEND": "torch", "KT_NUM_GPU_EXPERTS": "3", **env}, cores=4)
    runner = build_moe(KTHybridConfig(settings=settings))
    load(runner, random_experts(8, seed=3))
    seen = layers_seen(fresh_process_state)
    assert seen is not None
    assert whole_layer_from(settings.staging_min_tokens, settings.staging_split, 2048, 0, seen) == want


def _empty_output() -> object:
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    return EMPTY_MODEL_RUNNER_OUTPUT


def test_the_scheduler_module_is_what_the_catalogue_names() -> None:
    module, _, name = GATHERING_SCHEDULER.rpartition(".")
    assert Path(__file__).resolve().parents[3].joinpath(*module.split(".")).with_suffix(".py").is_file()
    import importlib

    assert getattr(importlib.import_module(module), name).__name__ == name
