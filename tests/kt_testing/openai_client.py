"""The OpenAI client's questions to a served tiny model: a completion and a chat, greedy,
with their token ids, for comparing servers."""

from __future__ import annotations

from openai import OpenAI

from vllm_kt_tools.support.server import VLLMServer

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
