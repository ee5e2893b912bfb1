"""`vllm serve --quantization kt-hybrid` (the real CLI and OpenAI server) answers the
completions and chat endpoints through the openai client with plain vLLM's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from engines import clean_env
from openai import OpenAI

from vllm_kt_plugin.cli import VLLMServer

pytestmark = pytest.mark.engine

SERVE_ARGS = ["--served-model-name", "tiny-moe", "--max-model-len", "256"]
PROMPT = "A mixture of experts"
QUESTION = "What is the capital of France?"


def ask(server: VLLMServer) -> dict:
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY")
    completion = client.completions.create(
        model="tiny-moe",
        prompt=PROMPT,
        max_tokens=20,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chat = client.chat.completions.create(
        model="tiny-moe",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=20,
        temperature=0.0,
        extra_body={"return_token_ids": True},
    )
    return {
        "completion_text": completion.choices[0].text,
        "completion_ids": completion.choices[0].model_extra["token_ids"],
        "chat_text": chat.choices[0].message.content,
        "chat_ids": chat.choices[0].model_extra["token_ids"],
    }


def serve(model: Path, log: Path, kt: dict[str, str] | None) -> dict:
    args = [*SERVE_ARGS, "--quantization", "kt-hybrid"] if kt is not None else SERVE_ARGS
    env = clean_env(**(kt or {"VLLM_PLUGINS": ""}))
    with VLLMServer(model, args, env=env, log_path=log) as server:
        return ask(server)


def demo_settings() -> dict[str, str]:
    lines = (Path(__file__).resolve().parents[1] / "configs" / "tiny-demo.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def test_openai_server_answers_like_plain_vllm(tiny_model, tmp_path: Path) -> None:
    model = tiny_model("qwen3_moe")
    hybrid = serve(model, tmp_path / "kt.log", demo_settings())
    assert "kt-hybrid" in (tmp_path / "kt.log").read_text()
    plain = serve(model, tmp_path / "plain.log", None)
    assert len(hybrid["completion_ids"]) == 20
    assert hybrid == plain
    assert hybrid["chat_text"].startswith("Paris is the capital of France.")
