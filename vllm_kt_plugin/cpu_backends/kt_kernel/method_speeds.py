"""The fastest kt-kernel method for this CPU, from a measured table: ``KT_METHOD=auto``.

``method_speeds.json`` beside this file (package data) holds one MoE layer's decode time
per kt-kernel CPU variant and method, keyed by the variant kt-kernel loaded. Reading a
table keeps serve's and doctor's start instant; measuring takes minutes. Where the table
comes from and how to regenerate it: docs/cpu-methods.md."""

from __future__ import annotations

import functools
import importlib.resources
import json
from dataclasses import dataclass
from typing import Any

TABLE = importlib.resources.files(__package__) / "method_speeds.json"
DECODE_BATCH = "1"  # ranked by batch-1 decode, the latency a single user sees
# Below this ratio two methods' times are the same within the shipped measurement's noise:
# it was taken on a shared host (load average 6-9), where AMXINT4 and LLAMAFILE Q4_K traded
# places from round to round (docs/cpu-methods.md).
NOISE_RATIO = 1.5


@dataclass(frozen=True)
class MethodSpeed:
    row: str  # e.g. "AMXINT4", "LLAMAFILE Q4_K"
    batch_ms: dict[str, float]  # ms per layer by batch size ("1", "16"): the best of the measured steps

    @property
    def method(self) -> str:
        """The KT_METHOD of the row."""
        return self.row.split()[0]

    @property
    def gguf_type(self) -> str | None:
        """The GGML type of a LLAMAFILE row's experts."""
        parts = self.row.split()
        return parts[1] if len(parts) > 1 else None

    def describe(self) -> str:
        times = ", ".join(f"{ms:g} ms at batch {n}" for n, ms in self.batch_ms.items())
        return f"{self.row} ({times})"


@functools.cache
def measured_table() -> dict[str, Any]:
    return json.loads(TABLE.read_text())


def ranking(variant: str) -> list[MethodSpeed]:
    """The measured methods of ``variant``'s kernels, fastest at batch-1 decode first (empty
    for a variant the table lacks)."""
    rows = measured_table()["variants"].get(variant, {})
    speeds = [MethodSpeed(row, {n: float(ms) for n, ms in times.items()}) for row, times in rows.items()]
    return sorted(speeds, key=lambda s: (s.batch_ms[DECODE_BATCH], s.batch_ms.get("16", 0.0)))


def source() -> str:
    """Where the table comes from, for log lines."""
    table = measured_table()
    return f"{table['source']} ({table['cpu_model']}, {table['threads']} kt-kernel thread(s), {table['shape']})"


def gguf_hint(speed: MethodSpeed) -> str:
    """What to point KT_WEIGHT_PATH at for a LLAMAFILE row."""
    kind = speed.gguf_type or "GGUF"
    file = f"{kind}_M" if kind.endswith("_K") else kind  # llama.cpp's file types: Q4_K_M, Q8_0
    return (
        f"set KT_METHOD=LLAMAFILE and point KT_WEIGHT_PATH at a {file} GGUF of this model (llama.cpp's "
        "convert_hf_to_gguf.py + llama-quantize, or a published one)"
    )


def pick_fastest(
    ranked: list[MethodSpeed], variant: str, *, gguf: bool, quantized: str | None
) -> tuple[MethodSpeed | None, str]:
    """KT_METHOD=auto's pick among ``ranked`` (this variant's runnable rows, fastest first)
    and its log line. GGUF weights allow LLAMAFILE only; a BF16/FP16 checkpoint allows BF16
    and AMXINT4/AMXINT8 (quantized online); a ``quantized`` checkpoint none of the table's
    (None: its own method). Where a faster row needs other weights, the line says which."""

    def allowed(speed: MethodSpeed) -> bool:
        if gguf:
            return speed.method == "LLAMAFILE"
        return speed.method != "LLAMAFILE" and quantized is None

    chosen = next((s for s in ranked if allowed(s)), None)
    if chosen is None:
        line = f"KT_METHOD=auto: the {quantized} checkpoint's own method (the measured methods cannot read it)"
    else:
        line = f"KT_METHOD=auto: {chosen.method}, the fastest on kt-kernel's {variant} kernels for these weights: "
        line += chosen.describe()
    fastest = ranked[0]
    if chosen is not fastest:
        hint = gguf_hint(fastest) if fastest.method == "LLAMAFILE" else "unset KT_WEIGHT_PATH, with a BF16 checkpoint"
        line += f"; faster here: {fastest.describe()}: {hint}"
    return chosen, f"{line} (measured: {source()})"
