"""Several GPUs: which process computes the CPU experts, how the host's cores and NUMA
nodes are divided among its kt-kernel processes, what a pipeline stage holds, and the
settings' way to Ray workers on other hosts."""

from __future__ import annotations

import logging

import pytest

from vllm_kt_plugin.settings.catalogue import LOGGER_NAME
from vllm_kt_plugin.settings.loader import environment_drift, load_settings
from vllm_kt_plugin.settings.variables import HostShare, host_share


@pytest.mark.parametrize(
    ("pp", "tp", "nodes", "stage", "expected"),
    [
        (1, 1, 1, 0, HostShare(1, 0)),
        (1, 4, 1, 0, HostShare(1, 0)),  # TP alone: only rank 0 runs kt-kernel
        (2, 1, 1, 1, HostShare(2, 1)),  # two stages, one host: they share it
        (4, 2, 1, 2, HostShare(4, 2)),
        (2, 4, 2, 1, HostShare(1, 0)),  # a stage per host: each has the host to itself
        (4, 2, 2, 3, HostShare(2, 1)),  # hosts hold stages 0-1 and 2-3
        (2, 8, 4, 1, HostShare(1, 0)),  # a stage spans two hosts; its rank 0 is on the third
    ],
)
def test_host_share_counts_the_stages_of_this_host(pp: int, tp: int, nodes: int, stage: int, expected) -> None:
    assert host_share(pp, tp, nodes, stage) == expected


def test_default_threads_divide_the_host_among_its_stages() -> None:
    alone = load_settings({}, cores=16, numa_nodes=1)
    assert alone.cpuinfer_threads == 14 and alone.numa_nodes is None
    stages = [alone.for_host(HostShare(2, i), cores=16, numa_nodes=2) for i in range(2)]
    assert [s.cpuinfer_threads for s in stages] == [7, 7]
    assert [s.numa_nodes for s in stages] == [(0,), (1,)]  # a node each
    assert "kt-kernel process 2 of 2 on this host" in stages[1].describe()
    assert alone.for_host(HostShare(), cores=16, numa_nodes=1) is alone  # the front end's host: unchanged
    # A worker on a bigger host sizes the default on its own cores; KT_CPUINFER stays as given.
    assert alone.for_host(HostShare(), cores=64, numa_nodes=1).cpuinfer_threads == 62
    given = load_settings({"KT_CPUINFER": "8"}, cores=16, numa_nodes=1)
    assert given.for_host(HostShare(), cores=64, numa_nodes=1).cpuinfer_threads == 8


def test_numa_pools_of_each_stage_on_its_own_nodes() -> None:
    env = {"KT_THREADPOOL_COUNT": "2"}
    settings = load_settings(env, cores=64, numa_nodes=4, share=HostShare(2, 1))
    assert (settings.cpuinfer_threads, settings.numa_nodes) == (31, (2, 3))
    shared = load_settings({}, cores=64, numa_nodes=1, share=HostShare(2, 1))
    assert shared.numa_nodes is None  # fewer nodes than stages: kt-kernel's default


def test_explicit_threads_oversubscribing_the_host_warn(caplog: pytest.LogCaptureFixture) -> None:
    plugin_logger = logging.getLogger(LOGGER_NAME)
    plugin_logger.addHandler(caplog.handler)
    try:
        caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
        settings = load_settings({"KT_CPUINFER": "10"}, cores=16, numa_nodes=1)
        assert caplog.text == ""  # 10 of 16 cores: fine for one process
        settings.for_host(HostShare(2, 0), cores=16, numa_nodes=1)
    finally:
        plugin_logger.removeHandler(caplog.handler)
    assert "KT_CPUINFER=10 in each of the 2 pipeline stages on this host (20 threads)" in caplog.text
    assert "KT_CPUINFER=7" in caplog.text  # the fix


class _Stage:
    """vLLM's pipeline group as a model sees it while building one stage."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank_in_group, self.world_size = rank, size
        self.is_first_rank, self.is_last_rank = rank == 0, rank == size - 1


@pytest.mark.parametrize("stage", [0, 1])
def test_a_pipeline_stage_computes_only_its_own_layers(vllm_layer_context, monkeypatch, stage: int) -> None:
    """Stage ``stage`` of 2 of a 6-layer model, built by vLLM's make_layers as models do:
    kt-kernel holds exactly that stage's layers, and no layer defers experts into a layer
    of the other stage (which another process computes)."""
    from vllm.distributed import parallel_state
    from vllm.model_executor.models.utils import PPMissingLayer, make_layers

    from vllm_kt_plugin.hybrid import process_state
    from vllm_kt_plugin.hybrid.quant_config import KTHybridConfig
    from vllm_kt_tools.support.moe_layers import build_moe

    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: _Stage(stage, 2))
    monkeypatch.setattr(process_state, "_PROCESS_STATE", process_state.HybridProcessState())  # no other layers
    settings = load_settings({"KT_NUM_GPU_EXPERTS": "2", "KT_MAX_DEFERRED_EXPERTS_PER_TOKEN": "1"}, cores=4)
    config = KTHybridConfig(settings=settings)
    start, end, modules = make_layers(
        6, lambda prefix: build_moe(config, decoder_layer=prefix), prefix=f"pp{stage}-of-2.model.layers"
    )
    assert (start, end) == ((0, 3) if stage == 0 else (3, 6))
    built = [i for i, m in enumerate(modules) if not isinstance(m, PPMissingLayer)]
    assert built == list(range(start, end))
    methods = process_state.process_state().layers
    assert [m.layer_idx for m in methods if m.cpu is not None] == built
    # Deferral into the next layer only inside the stage: never out of its last layer,
    # whether the model goes on in the next stage (stage 0) or ends (stage 1).
    assert [m._deferral() for m in methods] == [1, 1, 0]


def test_a_stage_budgets_its_own_layers() -> None:
    from vllm_kt_plugin.settings.model_memory import ModelMemory

    model = ModelMemory(num_experts=8, moe_layers=(1, 2, 3, 4, 5), expert_params=0, expert_bytes=1, non_expert_bytes=60)
    assert model.stage(range(3, 6), 6) == ModelMemory(8, (3, 4, 5), 0, 1, 30)
    assert model.stage(range(0, 3), 6).moe_layers == (1, 2)


def test_settings_travel_to_ray_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's Ray executor copies the driver's variables to its workers by prefix; after
    register() KT_* are among them, as VLLM_* are."""
    from vllm.ray.ray_env import get_env_vars_to_copy

    import vllm_kt_plugin

    monkeypatch.setenv("KT_NUM_GPU_EXPERTS", "3")
    monkeypatch.setenv("KT_KERNEL_SOMETHING", "1")
    monkeypatch.setattr(vllm_kt_plugin, "_registered", False)
    vllm_kt_plugin.register()
    copied = get_env_vars_to_copy(destination="workers")
    assert {"KT_NUM_GPU_EXPERTS", "KT_KERNEL_SOMETHING"} <= copied


def test_a_worker_environment_that_differs_is_named() -> None:
    """What a Ray worker on another host compares: its own KT_* against vllm serve's."""
    settings = load_settings({"KT_NUM_GPU_EXPERTS": "2", "KT_METHOD": "BF16"}, cores=16, numa_nodes=1)
    assert environment_drift(settings, {"KT_NUM_GPU_EXPERTS": "2", "KT_METHOD": "BF16", "PATH": "/bin"}) == []
    assert environment_drift(settings, {"KT_METHOD": "BF16", "KT_CPUINFER": "4"}) == [
        "KT_CPUINFER=4 (vllm serve: <unset>)",
        "KT_NUM_GPU_EXPERTS=<unset> (vllm serve: 2)",
    ]
