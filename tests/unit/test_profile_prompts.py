"""``vllm-kt profile``'s prompt files: text lines or JSONL (prompt, text or chat messages),
a bad line named by file and number (the profile itself: tests/engine/test_routing_profiler.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kt_tools.cli.profile import read_prompts


def test_prompt_files(tmp_path: Path) -> None:
    text = tmp_path / "p.txt"
    text.write_text("first prompt\n\nsecond prompt\n")
    assert read_prompts(text) == ["first prompt", "second prompt"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a"}\n{"text": "b"}\n{"messages": [{"role": "user", "content": "c"}]}\n')
    assert read_prompts(jsonl) == ["a", "b", {"messages": [{"role": "user", "content": "c"}]}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"oops": 1}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:2"):
        read_prompts(bad)
