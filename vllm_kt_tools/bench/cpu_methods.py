"""``vllm-kt bench --cpu-methods`` (and ``vllm-kt doctor --measure-methods``): which kt-kernel
method decodes fastest on this CPU, and on every other CPU class this host can stand in for.

One MoE layer of the Qwen3-30B-A3B shape (128 experts, top-8, hidden 2048, expert width
768), every expert on the CPU, is timed at decode (batch 1 and 16, fresh random routing at
every step, as decode meets it; the same tokens for every method; the best of 40 / 10
steps) for BF16, AMXINT4, AMXINT8 and LLAMAFILE with Q4_K and
Q8_0 GGUF experts. kt-kernel loads one CPU variant per process, chosen at import
(``KT_KERNEL_CPU_VARIANT`` forces one), so each variant this CPU can execute runs in a
process of its own: an AMX host measures what its AVX-512 and AVX2 builds do, i.e. what
an EPYC or an older Xeon would run. Threads: the plugin's default (usable cores - 2).

Weights are random (speed does not depend on the values): BF16 as a Hugging Face
safetensors layer, AMXINT4/AMXINT8 quantized online from BF16 tensors in each process, the
GGUF files written once (Q4_K from the published block layout: ``support.gguf_quants``).
The result is JSON; ``plugin_table`` reduces it to the table the plugin ships
(``vllm_kt_plugin/cpu_backends/kt_kernel/method_speeds.json``), which ``KT_METHOD=auto`` and
``vllm-kt doctor`` read.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from vllm_kt_plugin.source_checkout import checkout_path
from vllm_kt_tools.support.child import run_child

SHAPE = {"num_experts": 128, "top_k": 8, "hidden": 2048, "inter": 768}  # Qwen3-30B-A3B's MoE layer
TOKENS = (1, 16)
# kt-kernel's buffers hold this many tokens (the plugin sizes it to vLLM's token budget);
# its AVX-512 INT4/INT8 kernels need a multiple of their row tile ("max_m ... must be multiple").
CHUNK = 256
STEPS = {1: 40, 16: 10}  # timed decode steps per batch size (after 3 untimed ones)
# (row name, KT_METHOD, GGML type of the GGUF experts)
METHODS = (
    ("BF16", "BF16", None),
    ("AMXINT4", "AMXINT4", None),
    ("AMXINT8", "AMXINT8", None),
    ("LLAMAFILE Q4_K", "LLAMAFILE", "Q4_K"),
    ("LLAMAFILE Q8_0", "LLAMAFILE", "Q8_0"),
)
# kt-kernel 0.7.2's CPU variants from the most to the least capable (kt_kernel._cpu_detect).
VARIANTS = ("amx", "avx512_bf16", "avx512_vbmi", "avx512_vnni", "avx512_base", "avx2")


def runnable_variants() -> list[str]:
    """The variants this CPU executes: the one kt-kernel detects and every one below it."""
    from kt_kernel._cpu_detect import detect_cpu_features

    saved = os.environ.pop("KT_KERNEL_CPU_VARIANT", None)
    try:
        detected = detect_cpu_features()
    finally:
        if saved is not None:
            os.environ["KT_KERNEL_CPU_VARIANT"] = saved
    return list(VARIANTS[VARIANTS.index(detected) :])


def write_weights(workdir: Path) -> dict[str, str]:
    """The layer's weights in each stored format, written once: row name -> KT_WEIGHT_PATH."""
    from vllm_kt_tools.support.gguf_export import write_random_experts
    from vllm_kt_tools.support.quantized_checkpoints import write_dummy_experts

    e, h, i = SHAPE["num_experts"], SHAPE["hidden"], SHAPE["inter"]
    paths = {
        "BF16": str(write_dummy_experts(workdir / "bf16", "BF16", [0], e, h, i)),
        "online": str(workdir / "online"),
    }
    for name, _, ggml_type in METHODS:
        if ggml_type is None:
            continue
        path = workdir / f"layer-{ggml_type}.gguf"
        if not path.exists():
            started = time.perf_counter()
            partial = path.with_suffix(".partial")
            write_random_experts(partial, [0], e, h, i, ggml_type)
            partial.rename(path)
            print(f"[cpu-methods] {path} written in {time.perf_counter() - started:.0f} s", flush=True)
        paths[name] = str(path)
    return paths


def _layer(method: str, weight_path: str | None, threads: int, online_dir: str) -> Any:
    import torch

    from vllm_kt_plugin.cpu_backends.kt_kernel.compat import prepare_kt_kernel

    kt_kernel = prepare_kt_kernel()
    e = SHAPE["num_experts"]
    wrapper = kt_kernel.KTMoEWrapper(
        layer_idx=0,
        num_experts=e,
        num_experts_per_tok=SHAPE["top_k"],
        hidden_size=SHAPE["hidden"],
        moe_intermediate_size=SHAPE["inter"],
        gpu_experts_mask=torch.zeros(e, dtype=torch.bool),
        cpuinfer_threads=threads,
        threadpool_count=1,
        weight_path=weight_path or online_dir,  # AMXINT4/AMXINT8 write their quantized experts there
        chunked_prefill_size=CHUNK,
        method=method,
    )
    mapping = torch.arange(e, dtype=torch.long)
    if weight_path is None:  # AMXINT4/AMXINT8: quantized online from BF16 tensors
        gen = torch.Generator().manual_seed(0)
        h, i = SHAPE["hidden"], SHAPE["inter"]

        def drawn(rows: int, cols: int) -> Any:
            return (torch.randn(e, rows, cols, generator=gen) * 0.02).to(torch.bfloat16)

        wrapper.load_weights_from_tensors(drawn(i, h), drawn(i, h), drawn(h, i), mapping)
    else:
        wrapper.load_weights(mapping)
    return wrapper, mapping


def time_variant(weights: dict[str, str], threads: int) -> dict[str, Any]:
    """Every method's decode time in this process's kt-kernel variant (runs in the child)."""
    import torch

    from vllm_kt_plugin.cpu_backends.kt_kernel.compat import prepare_kt_kernel
    from vllm_kt_plugin.cpu_backends.kt_kernel.methods import broken_kernel, kernel_available

    kt_kernel = prepare_kt_kernel()
    out: dict[str, Any] = {"variant": str(kt_kernel.__cpu_variant__), "threads": threads, "methods": {}}
    e, k, h = SHAPE["num_experts"], SHAPE["top_k"], SHAPE["hidden"]
    for name, method, _ in METHODS:
        if not kernel_available(method):
            out["methods"][name] = {"skipped": broken_kernel(method) or f"no {method} kernel in this build"}
            continue
        started = time.perf_counter()
        online = method in ("AMXINT4", "AMXINT8")  # quantized in this process, from BF16 tensors
        try:
            scratch = f"{weights['online']}/{out['variant']}-{method}"  # kt-kernel writes here (not the cwd)
            wrapper, keep = _layer(method, None if online else weights[name], threads, scratch)
        except Exception as exc:  # kt-kernel refused this method in this variant: recorded, not fatal
            out["methods"][name] = {"skipped": f"kt-kernel failed to load it: {str(exc).splitlines()[0]}"}
            print(f"[cpu-methods] {out['variant']} {name}: {out['methods'][name]}", flush=True)
            continue
        row: dict[str, Any] = {"load_s": round(time.perf_counter() - started, 1)}
        # one untimed forward through every expert: kt-kernel may keep a GGUF's experts in
        # its memory map, whose pages are first read at an expert's first use
        every = torch.arange(e).reshape(e // k, k)
        warm = torch.zeros(e // k, h, dtype=torch.bfloat16)
        wrapper.submit_forward(warm, every, torch.ones(e // k, k), 0)
        wrapper.sync_forward(warm, 0)
        gen = torch.Generator().manual_seed(1)  # every method and variant sees the same tokens and routing
        for n in TOKENS:
            x = (torch.randn(n, h, generator=gen) * 0.1).to(torch.bfloat16)
            times = []
            for step in range(3 + STEPS[n]):
                ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
                scores = torch.rand(n, k, generator=gen)
                begun = time.perf_counter()
                wrapper.submit_forward(x, ids, scores, 0)
                wrapper.sync_forward(x, 0)
                if step >= 3:
                    times.append((time.perf_counter() - begun) * 1e3)
            # the best step is the figure: on a shared machine the others are slowed by whatever
            # else runs (random preemption only adds time); median and worst show how much
            row[f"batch_{n}_ms"] = round(min(times), 3)
            row[f"batch_{n}_ms_median_max"] = [round(statistics.median(times), 3), round(max(times), 3)]
        out["methods"][name] = row
        print(f"[cpu-methods] {out['variant']} {name}: {json.dumps(row)}", flush=True)
        del wrapper, keep
    return out


def measure(
    workdir: Path, variants: list[str] | None = None, timeout_s: int = 1800, repeats: int = 1
) -> dict[str, Any]:
    """Every runnable variant (or ``variants``), each in a fresh process, ``repeats`` rounds
    (each row keeps its best round)."""
    from vllm_kt_plugin.settings.variables import default_cpuinfer_threads, usable_cores
    from vllm_kt_tools.bench.host import host_info

    workdir.mkdir(parents=True, exist_ok=True)
    weights = write_weights(workdir)
    threads = default_cpuinfer_threads(usable_cores())
    report: dict[str, Any] = {
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": host_info(),
        "shape": {**SHAPE, "name": "Qwen3-30B-A3B MoE layer"},
        "threads": threads,
        "steps": {str(n): s for n, s in STEPS.items()},
        "variants": {},
    }
    report["repeats"] = repeats
    for repeat in range(repeats):  # rounds over all variants: a busy spell of the host hits one round
        for variant in variants or runnable_variants():
            log_path = workdir / f"{variant}-{repeat + 1}.log"
            print(f"[cpu-methods] variant {variant}, round {repeat + 1}: starting (log: {log_path})", flush=True)
            env = {**os.environ, "KT_KERNEL_CPU_VARIANT": variant}
            run = run_child(
                f"{__name__}:time_variant",
                {"weights": weights, "threads": threads},
                env=env,
                timeout_s=timeout_s,
                log_path=log_path,
            )
            result = run.result if run.result is not None else {"error": " | ".join(run.tail(5).splitlines())[-1500:]}
            # the host's 1-minute load after the variant: other processes on the cores slow
            # every method's steps (the median and worst beside each best step show how much)
            result["load_average_1m"] = round(os.getloadavg()[0], 2)
            report["variants"][variant] = best_of(report["variants"].get(variant), result)
    report["fastest"] = fastest_by_variant(report)
    return report


def best_of(earlier: dict[str, Any] | None, result: dict[str, Any]) -> dict[str, Any]:
    """A variant's result over rounds: each method's figure per batch size from its fastest
    round (with that round's median and worst), every round's load kept."""
    if earlier is None or "methods" not in earlier:
        return {**result, "load_average_1m": [result["load_average_1m"]]}
    merged = {**earlier, "load_average_1m": [*earlier["load_average_1m"], result["load_average_1m"]]}
    for name, row in result.get("methods", {}).items():
        old = dict(earlier["methods"].get(name, {}))
        if "skipped" in old or not old:
            merged["methods"][name] = row
            continue
        for n in TOKENS:
            if f"batch_{n}_ms" in row and row[f"batch_{n}_ms"] < old[f"batch_{n}_ms"]:
                old[f"batch_{n}_ms"] = row[f"batch_{n}_ms"]
                old[f"batch_{n}_ms_median_max"] = row[f"batch_{n}_ms_median_max"]
        merged["methods"][name] = old
    return merged


def fastest_by_variant(report: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Per variant and batch size, the row with the least time (best step)."""
    fastest: dict[str, dict[str, str]] = {}
    for variant, result in report["variants"].items():
        rows = {name: row for name, row in result.get("methods", {}).items() if "skipped" not in row}
        fastest[variant] = {
            f"batch_{n}": min(rows, key=lambda name, n=n: rows[name][f"batch_{n}_ms"]) for n in TOKENS if rows
        }
    return fastest


def plugin_table(report: dict[str, Any], source: str) -> dict[str, Any]:
    """What the plugin ships of a measurement: per variant, each method's best-step ms per
    batch size (``KT_METHOD=auto`` and doctor read it; a unit test keeps it equal to this
    reduction of the committed result)."""
    return {
        "source": source,
        "command": report["command"],
        "measured_utc": report["started_utc"],
        "cpu_model": report["host"].get("cpu_model"),
        "threads": report["threads"],
        "shape": report["shape"]["name"],
        "variants": {
            variant: {
                name: {str(n): row[f"batch_{n}_ms"] for n in TOKENS}
                for name, row in result.get("methods", {}).items()
                if "skipped" not in row
            }
            for variant, result in report["variants"].items()
            if "methods" in result
        },
    }


def format_table(report: dict[str, Any]) -> str:
    """The measurement as text: one line per variant and method, fastest marked."""
    lines = [f"{'variant':<12} {'method':<16} {'batch 1 ms':>10} {'batch 16 ms':>11}"]
    for variant, result in report["variants"].items():
        best = report.get("fastest", {}).get(variant, {})
        if "error" in result:
            lines.append(f"{variant:<12} failed: {result['error'][-200:]}")
            continue
        for name, row in result["methods"].items():
            if "skipped" in row:
                lines.append(f"{variant:<12} {name:<16} skipped ({row['skipped']})")
                continue
            marks = "".join(f" fastest at batch {n}" for n in TOKENS if best.get(f"batch_{n}") == name)
            lines.append(f"{variant:<12} {name:<16} {row['batch_1_ms']:>10.3f} {row['batch_16_ms']:>11.3f}{marks}")
    return "\n".join(lines)


# docs/cpu-methods.md's table, between these markers (the README links it).
DOC = ("docs", "cpu-methods.md")
TABLE_START, TABLE_END = "<!-- cpu-methods:start -->", "<!-- cpu-methods:end -->"
# Which CPUs load each variant (kt_kernel._cpu_detect's feature requirements).
VARIANT_CPUS = {
    "amx": "Xeon Sapphire Rapids and newer",
    "avx512_bf16": "EPYC Zen 4/5",
    "avx512_vbmi": "Xeon Ice Lake",
    "avx512_vnni": "Xeon Cascade/Cooper Lake",
    "avx512_base": "Xeon Skylake-SP",
    "avx2": "EPYC Zen 2/3, older Xeon",
}


def doc_table(report: dict[str, Any], source: str) -> str:
    """docs/cpu-methods.md's table of the measurement (between its markers): ms per layer at
    batch 1 / 16, the fastest at batch 1 in bold."""
    names = [name for name, _, _ in METHODS]
    lines = [
        TABLE_START,
        f"<!-- generated: python -m vllm_kt_tools.bench.cpu_methods {source} -->",
        "| kt-kernel variant (CPUs) | " + " | ".join(names) + " |",
        "| --- |" + " --- |" * len(names),
    ]
    for variant, result in report["variants"].items():
        best = report["fastest"].get(variant, {}).get("batch_1")
        cells = []
        for name in names:
            row = result.get("methods", {}).get(name, {})
            if "batch_1_ms" not in row:
                cells.append("n/a")
                continue
            cell = f"{row['batch_1_ms']:.2f} / {row['batch_16_ms']:.1f}"
            cells.append(f"**{cell}**" if name == best else cell)
        lines.append(f"| `{variant}` ({VARIANT_CPUS[variant]}) | " + " | ".join(cells) + " |")
    lines.append(TABLE_END)
    return "\n".join(lines)


def replace_doc_table(doc: str, report: dict[str, Any], source: str) -> str:
    start, end = doc.index(TABLE_START), doc.index(TABLE_END) + len(TABLE_END)
    return doc[:start] + doc_table(report, source) + doc[end:]


def main(argv: list[str] | None = None) -> None:
    """Write docs/cpu-methods.md's table of a committed measurement (its path in the checkout)."""
    import sys

    source = (argv if argv is not None else sys.argv[1:])[0]
    command = "python -m vllm_kt_tools.bench.cpu_methods"
    doc = checkout_path(*DOC, needed_by=command)
    report = json.loads(checkout_path(source, needed_by=command).read_text())
    doc.write_text(replace_doc_table(doc.read_text(), report, source))
    print(f"wrote {doc}")


if __name__ == "__main__":
    main()
