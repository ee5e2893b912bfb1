"""The sitting's first sglang-kt step, run on the GPU host under sglang-kt's own Python
(``$SGLANG_PYTHON -m vllm_kt_tools.bench.sglang_check``, from the repo root): can this
package set start sglang-kt's server for the benchmark? It imports what the server imports,
loads ``sgl_kernel``'s compiled ops for this GPU and prints one line of versions; on the
first failure it prints ONE line naming the step and the error and exits 1, so that the
sitting drops its sglang-kt part instead of spending minutes on a server that cannot start
(2026-12-06: IPython missing, then ``sgl_kernel/sm90/common_ops`` missing).

Steps, in order: torch (and the GPU's compute capability), ``sgl_kernel`` (its
``common_ops`` must come from ``sm90/`` on capability 9.0: the ``ktransformers`` wheel's),
FA3 (``sgl_kernel.flash_attn``: sglang's default attention on sm90, materialised from the five
payload wheels on first import, so the server start does not pay for it), kt_kernel,
``sglang.launch_server`` and its HTTP server, then the model registry: Qwen3-MoE must be
there and kt-kernel's MoE wrapper registered (``sglang.srt.models.deepseek_v4`` registers it
for every model, in an import whose failure the registry only logs: without it sglang-kt
would serve all experts on the GPU and look fast).

Imports only the standard library at module level: it runs where vLLM is not installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PREFIX = "[sglang-check]"
QWEN3_MOE = "Qwen3MoeForCausalLM"
KT_WRAPPER_ID = "kt_ep"


class CheckFailed(Exception):
    """A step's own verdict (not an exception of the code it ran)."""


def common_ops_verdict(capability: tuple[int, int] | None, ops_file: str) -> str | None:
    """Why ``sgl_kernel``'s loaded ``common_ops`` is the wrong one for this GPU, or None.
    On capability 9.0 sgl_kernel's loader takes ``sm90/`` (``sgl_kernel/load_utils.py``);
    any other file there means a fallback this package set must not rely on."""
    if capability == (9, 0) and Path(ops_file).parent.name != "sm90":
        return f"capability 9.0 loaded {ops_file}, not sgl_kernel/sm90/common_ops"
    return None


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first non-empty line of its message
    (sgl_kernel's ImportError opens with a blank line, then "CRITICAL: ...")."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def run_steps(steps: list[tuple[str, Callable[[], str | None]]]) -> tuple[list[str], str | None]:
    """Each step in order; its note (if any) kept. Stops at the first failure and returns
    the notes so far and ``"<step>: <error>"``."""
    notes: list[str] = []
    for name, step in steps:
        try:
            note = step()
        except CheckFailed as exc:
            return notes, f"{name}: {exc}"
        except BaseException as exc:  # noqa: BLE001 - any failure of an import is the verdict
            if isinstance(exc, KeyboardInterrupt):
                raise
            return notes, f"{name}: {one_line(exc)}"
        if note:
            notes.append(note)
    return notes, None


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_steps(want_gpu: bool = True) -> list[tuple[str, Callable[[], str | None]]]:
    """The checks, in the order the server would meet them."""
    state: dict[str, Any] = {}

    def torch_step() -> str:
        import torch

        state["torch"] = torch
        if not torch.cuda.is_available():
            if want_gpu:
                raise CheckFailed(f"torch {torch.__version__} sees no CUDA device")
            return f"torch {torch.__version__} (no GPU)"
        capability = torch.cuda.get_device_capability(0)
        state["capability"] = capability
        return (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, "
            f"capability {capability[0]}.{capability[1]})"
        )

    def sgl_kernel_step() -> str:
        started = time.perf_counter()
        sgl_kernel = importlib.import_module("sgl_kernel")
        ops_file = str(getattr(sgl_kernel.common_ops, "__file__", "?"))
        wrong = common_ops_verdict(state.get("capability"), ops_file)
        if wrong:
            raise CheckFailed(wrong)
        where = "/".join(Path(ops_file).parts[-2:])
        version = getattr(sgl_kernel, "__version__", "?")
        return f"sgl_kernel {version} ({where}, {time.perf_counter() - started:.0f} s)"

    def fa3_step() -> str:
        started = time.perf_counter()
        importlib.import_module("sgl_kernel.flash_attn")
        return f"FA3 loaded ({time.perf_counter() - started:.0f} s)"

    def kt_kernel_step() -> str:
        kt_kernel = importlib.import_module("kt_kernel")
        return f"kt_kernel {getattr(kt_kernel, '__version__', '?')} ({getattr(kt_kernel, '__cpu_variant__', '?')})"

    def launch_server_step() -> str:
        importlib.import_module("sglang.launch_server")
        return f"sglang-kt {_version('sglang-kt')}"

    def http_server_step() -> None:
        importlib.import_module("sglang.srt.entrypoints.http_server")

    def registry_step() -> str:
        registry = importlib.import_module("sglang.srt.models.registry").ModelRegistry
        if QWEN3_MOE not in registry.models:
            raise CheckFailed(f"{QWEN3_MOE} is not in sglang's model registry")
        wrappers = importlib.import_module("sglang.srt.layers.moe.quant_method_registry")._QUANT_WRAPPERS
        if not any(entry[1] == KT_WRAPPER_ID for entry in wrappers):
            raise CheckFailed(
                f"kt-kernel's MoE wrapper ({KT_WRAPPER_ID}) is not registered: sglang.srt.models.deepseek_v4 "
                "did not import sglang.srt.layers.moe.kt_ep_wrapper (its log warns why)"
            )
        return f"{QWEN3_MOE} with kt-kernel's wrapper"

    steps: list[tuple[str, Callable[[], str | None]]] = [
        ("torch", torch_step),
        ("sgl_kernel", sgl_kernel_step),
        ("FA3 (sgl_kernel.flash_attn)", fa3_step),
        ("kt_kernel", kt_kernel_step),
        ("import sglang.launch_server", launch_server_step),
        ("import sglang.srt.entrypoints.http_server", http_server_step),
        ("model registry", registry_step),
    ]
    return steps


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m vllm_kt_tools.bench.sglang_check", description=__doc__)
    parser.add_argument(
        "--no-gpu", action="store_true", help="accept a host without a GPU (a CPU-side trial of the package set)"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    notes, failure = run_steps(build_steps(want_gpu=not args.no_gpu))
    nvcc = shutil.which("nvcc")
    notes.append(f"nvcc {nvcc or 'absent (flashinfer cannot JIT-compile here)'}")
    if failure:
        print(f"{PREFIX} FAILED {failure}", flush=True)
        return 1
    print(f"{PREFIX} ok in {time.perf_counter() - started:.0f} s: {'; '.join(notes)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
