"""The plugin's registration contract with vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap


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
        deferred = ("vllm_kt_plugin.quant_config", "vllm_kt_plugin.moe_method", "kt_kernel")
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
        print(json.dumps({
            "count": QUANTIZATION_METHODS.count("kt-hybrid"),
            "cls": get_quantization_config("kt-hybrid").__name__,
            "kt_kernel_imported": "kt_kernel" in sys.modules,
            "fused_moe_method_imported": "vllm_kt_plugin.moe_method" in sys.modules,
        }))
        """
    )
    assert out == {"count": 1, "cls": "KTHybridConfig", "kt_kernel_imported": False, "fused_moe_method_imported": False}


def test_vllm_plugins_can_exclude_it() -> None:
    out = run_python(
        """
        import json
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
        print(json.dumps({"registered": "kt-hybrid" in QUANTIZATION_METHODS}))
        """,
        VLLM_PLUGINS="lora_filesystem_resolver",
    )
    assert out == {"registered": False}
