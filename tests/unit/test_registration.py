"""The plugin's registration contract with vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest


def run_python(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter (a clean vLLM process); it prints JSON."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_registers_nothing() -> None:
    out = run_python(
        """
        import json, sys
        import vllm_kt_plugin
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
        deferred = ("vllm_kt_plugin.hybrid.quant_config", "vllm_kt_plugin.hybrid.moe_method", "kt_kernel")
        heavy = [m for m in deferred if m in sys.modules]
        print(json.dumps({"registered": "kt-hybrid" in QUANTIZATION_METHODS, "heavy": heavy}))
        """
    )
    assert out == {"registered": False, "heavy": []}


def test_vllm_loads_the_entry_point_and_register_is_idempotent() -> None:
    out = run_python(
        """
        import json, time
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
        import vllm_kt_plugin, sys
        start = time.perf_counter()
        for _ in range(3):
            vllm_kt_plugin.register()
        from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
        print(json.dumps({
            "count": QUANTIZATION_METHODS.count("kt-hybrid"),
            "cpu_router_fixed": getattr(CPURouter._compute_routing, "kt_one_group", False),
            "cls": get_quantization_config("kt-hybrid").__name__,
            "kt_kernel_imported": "kt_kernel" in sys.modules,
            "fused_moe_method_imported": "vllm_kt_plugin.hybrid.moe_method" in sys.modules,
        }))
        """
    )
    assert out == {
        "count": 1,
        "cpu_router_fixed": True,  # on vLLM's CPU build, as this test's
        "cls": "KTHybridConfig",
        "kt_kernel_imported": False,
        "fused_moe_method_imported": False,
    }


@pytest.mark.parametrize(
    ("allowed", "registered"), [("lora_filesystem_resolver", False), ("lora_filesystem_resolver,kt_hybrid", True)]
)
def test_vllm_plugins_can_exclude_it(allowed: str, registered: bool) -> None:
    """VLLM_PLUGINS is an allowlist: vLLM loads exactly the general plugins it names, so
    kt-hybrid is registered where it is named and only there (the other plugin loads either
    way, so neither outcome is a broken entry point)."""
    out = run_python(
        """
        import json
        from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_general_plugins, load_plugins_by_group
        loaded = sorted(load_plugins_by_group(DEFAULT_PLUGINS_GROUP))
        load_general_plugins()
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
        print(json.dumps({"loaded": loaded, "registered": "kt-hybrid" in QUANTIZATION_METHODS}))
        """,
        VLLM_PLUGINS=allowed,
    )
    assert out == {"loaded": sorted(allowed.split(",")), "registered": registered}


MISSPELLED_PLUGIN = """
from vllm_kt_plugin.hookspecs import hookimpl


@hookimpl
def kt_cpu_backend():  # the hook is kt_cpu_backends
    return {}
"""


def test_a_misspelled_backend_hook_fails_loudly(tmp_path) -> None:
    """A third-party backend whose hook name is misspelled is refused when the backends are
    collected (pluggy's check_pending), naming the hook, instead of silently never offered."""
    (tmp_path / "kt_misspelled.py").write_text(MISSPELLED_PLUGIN)
    dist = tmp_path / "kt_misspelled-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kt-misspelled\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[vllm_kt_plugin.cpu_backends]\nmisspelled = kt_misspelled\n")
    code = "from vllm_kt_plugin.cpu_backends.registry import available_backends; available_backends()"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0
    assert "PluginValidationError" in proc.stderr and "kt_cpu_backend" in proc.stderr, proc.stderr[-3000:]
    ok = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]  # without the bad plugin, the same call works


def test_kt_cpu_router_applies_only_the_router_fix(tmp_path) -> None:
    """The ``kt_cpu_router`` entry point pyproject.toml declares (installed here from a
    dist-info of those entry points, so the test does not depend on the editable install's
    age): with ``VLLM_PLUGINS=kt_cpu_router`` vLLM's CPU router routes sigmoid top-k without
    groups, and kt-hybrid is not registered."""
    from pathlib import Path

    import tomllib

    declared = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    points = declared["project"]["entry-points"]["vllm.general_plugins"]
    assert points["kt_cpu_router"] == "vllm_kt_plugin:register_cpu_router"
    dist = tmp_path / "kt_router_points-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kt-router-points\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\nkt_cpu_router = {points['kt_cpu_router']}\n")
    out = run_python(
        """
        import json, torch
        from vllm.plugins import load_general_plugins
        from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
        bias = torch.zeros(8)
        router = CPURouter(top_k=2, global_num_experts=8, scoring_func="sigmoid", e_score_correction_bias=bias)
        def routes():
            try:
                router._compute_routing(torch.zeros(3, 4), torch.randn(3, 8), None)
                return True
            except AssertionError:
                return False
        before = routes()
        load_general_plugins()
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
        print(json.dumps({"before": before, "after": routes(), "kt_hybrid": "kt-hybrid" in QUANTIZATION_METHODS}))
        """,
        VLLM_PLUGINS="kt_cpu_router",
        PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(tmp_path)])),
    )
    assert out == {"before": False, "after": True, "kt_hybrid": False}
