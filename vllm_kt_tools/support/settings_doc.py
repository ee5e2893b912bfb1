"""docs/settings.md, generated from the settings catalogue (``vllm_kt_plugin.settings.
catalogue.VARIABLES``), as vLLM generates its environment-variable page from envs.py.

    python -m vllm_kt_tools.support.settings_doc      # rewrite docs/settings.md

``tests/unit/test_settings_doc.py`` regenerates it and compares, so the document never
drifts from the code."""

from __future__ import annotations

import sys
from pathlib import Path

from vllm_kt_plugin.settings.catalogue import KT_KERNEL_OWN_VARIABLES, VARIABLES, Variable
from vllm_kt_plugin.source_checkout import checkout_path
from vllm_kt_tools.support import weight_matrix


def doc_path() -> Path:
    """docs/settings.md of the source checkout."""
    return checkout_path("docs", "settings.md", needed_by="python -m vllm_kt_tools.support.settings_doc")


HEADER = """\
# Settings

<!-- Generated from vllm_kt_plugin/settings/catalogue.py by
     `python -m vllm_kt_tools.support.settings_doc`; edit the catalogue, not this file. -->

kt-hybrid reads these `KT_*` environment variables where `vllm serve` starts (vLLM copies
them to its workers). A `KT_CONFIG` preset sets several at once; a variable set in the
environment wins over the preset. Every value is checked once, at config time, before any
weight loads: a mistake is one line naming the variable, its value and what is allowed.

"""


WEIGHT_PATHS = """
## KT_WEIGHT_PATH and KT_METHOD

What serve does with each kind of `KT_WEIGHT_PATH` under each `KT_METHOD` that kt-kernel
0.7.2's x86 builds carry a kernel for (whether this CPU's build has it is checked first, and
refused on its own). Generated from the cases `tests/unit/test_weight_paths.py` runs
(`vllm_kt_tools/support/weight_matrix.py`): every pair either serves or stops at config time,
before any weight loads, with one line naming what the path holds, what the method reads and
what to do; `vllm-kt doctor --model DIR` says the same line. The check reads file names and
safetensors/GGUF headers only. For example, the report that started it (AMXINT8 on a tiny
Qwen3-MoE, `KT_WEIGHT_PATH` its own folder), where kt-kernel once failed in a worker with
`No experts found for key blk.0`:

```
{reported}
```

Methods: {methods}. Unset, each method reads its default: `BF16`, `FP8` and the other
checkpoint methods the model's own folder (the method must be the checkpoint's own);
`AMXINT4`/`AMXINT8` quantize a BF16/FP16 checkpoint at the first start into `KT_CACHE_DIR`;
`LLAMAFILE` needs a path. A converted folder must also hold every MoE layer of the model,
every expert of the model's sizes, for `KT_THREADPOOL_COUNT` NUMA parts.

"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _meaning(variable: Variable) -> str:
    former = ", ".join(f"`{name}`" for name in variable.old_names)
    return f"{variable.help} (formerly {former}, still read)" if former else variable.help


def render() -> str:
    rows = ["| Variable | Default | Allowed | Meaning |", "| --- | --- | --- | --- |"]
    rows += [f"| `{v.name}` | {_cell(v.default)} | {_cell(v.allowed)} | {_cell(_meaning(v))} |" for v in VARIABLES]
    own = ", ".join(f"`{name}`" for name in sorted(KT_KERNEL_OWN_VARIABLES))
    footer = (
        "\nkt-kernel reads variables of its own that share the prefix; kt-hybrid passes them by "
        f"and warns about no other unknown `KT_*` name: {own}.\n"
    )
    matrix = WEIGHT_PATHS.replace("{methods}", ", ".join(f"`{m}`" for m in weight_matrix.METHODS)).replace(
        "{reported}", weight_matrix.REPORTED.format(path="/m")
    )
    return HEADER + "\n".join(rows) + "\n" + footer + matrix + weight_matrix.render()


def main() -> int:
    doc = doc_path()
    doc.parent.mkdir(exist_ok=True)
    doc.write_text(render())
    print(f"wrote {doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
