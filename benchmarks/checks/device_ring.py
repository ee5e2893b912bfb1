"""The decode timeline's device ring on a real GPU, with torch and Triton alone (no vLLM):
its stamps captured into a CUDA graph, each replay writing its own step, in order. The same
check as tests/unit/hybrid/test_decode_timeline.py's GPU test, for a host without pytest or vLLM.

    python benchmarks/checks/device_ring.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.modules["vllm"] = None  # type: ignore[assignment] - proves nothing of vLLM is needed

import torch  # noqa: E402

from vllm_kt_plugin.hybrid.decode_timeline import POINTS, step_rows  # noqa: E402
from vllm_kt_plugin.hybrid.device_clock import DeviceRing  # noqa: E402


def main() -> None:
    ring = DeviceRing(torch.device("cuda"), [5, 9], len(POINTS), ring_steps=4)
    x = torch.randn(256, 256, device="cuda")

    def step() -> None:
        for layer in (5, 9):
            for point in range(len(POINTS)):
                ring.stamp(layer, point, 16)
                x.copy_(x @ x.T / 256)

    step()
    eager = ring.read()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(6):
        graph.replay()
    rows = step_rows(ring.read(), [5, 9])
    ok = len(eager) == 1 and len(rows) == 4 and all(r["tokens"] == 16 for r in rows) and ring.read() == []
    ok = ok and all(r["step_ms"] is not None and r["step_ms"] > 0 for r in rows[:-1])
    print(json.dumps({"ok": ok, "gpu": torch.cuda.get_device_name(), "rows": rows}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
