"""docs/settings.md, generated from the settings catalogue (``vllm_kt_plugin.settings.
catalogue.VARIABLES``), as vLLM generates its environment-variable page from envs.py.

    python -m vllm_kt_tools.support.settings_doc      # rewrite docs/settings.md

``tests/unit/test_settings_doc.py`` regenerates it and compares, so the document never
drifts from the code."""

from __future__ import annotations

import sys
from pathlib import Path

from vllm_kt_plugin.settings.catalogue import KT_KERNEL_OWN_VARIABLES, VARIABLES
from vllm_kt_plugin.source_checkout import checkout_path


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


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    rows = ["| Variable | Default | Allowed | Meaning |", "| --- | --- | --- | --- |"]
    rows += [f"| `{v.name}` | {_cell(v.default)} | {_cell(v.allowed)} | {_cell(v.help)} |" for v in VARIABLES]
    own = ", ".join(f"`{name}`" for name in sorted(KT_KERNEL_OWN_VARIABLES))
    footer = (
        "\nkt-kernel reads variables of its own that share the prefix; kt-hybrid passes them by "
        f"and warns about no other unknown `KT_*` name: {own}.\n"
    )
    return HEADER + "\n".join(rows) + "\n" + footer


def main() -> int:
    doc = doc_path()
    doc.parent.mkdir(exist_ok=True)
    doc.write_text(render())
    print(f"wrote {doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
