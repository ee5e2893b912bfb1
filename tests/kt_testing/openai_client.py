"""The OpenAI client's questions to a served tiny model: a completion and a chat, greedy,
with their token ids, for comparing servers."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

from vllm_kt_tools.support.server import VLLMServer
from vllm_kt_tools.support.tiny_models import training_text

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


def burst_prompts(count: int = 8, words: int = 20) -> list[str]:
    """``count`` different passages of the tiny models' training text, ``words`` words each
    (each more than 16 tokens)."""
    text = training_text().split()
    return [" ".join(text[i * 7 : i * 7 + words]) for i in range(count)]


def burst(server: VLLMServer, prompts: list[str], apart_s: float = 0.1, max_tokens: int = 8) -> list[dict]:
    """``prompts`` sent ``apart_s`` after one another, each from its own thread, without
    waiting for the answers: greedy completions (``token_ids``) and each prompt's tokens."""
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY")

    def complete(i: int) -> dict:
        time.sleep(i * apart_s)
        answer = client.completions.create(
            model="tiny-moe",
            prompt=prompts[i],
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return {"token_ids": answer.choices[0].model_extra["token_ids"], "prompt_tokens": answer.usage.prompt_tokens}

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(complete, range(len(prompts))))
