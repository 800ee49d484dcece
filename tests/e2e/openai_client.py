#!/usr/bin/env python3
"""Drives a tandem router's HTTP endpoint with the official `openai` Python package, as a
client of an OpenAI-compatible server would: a streamed chat completion and a streamed text
completion, each asking for usage in the final chunk. Prints one JSON object:

    {"chat": {"text": ..., "usage": {...}, "chunks": N}, "completion": {...}, "models": [...]}

Usage: openai_client.py BASE_URL (e.g. http://127.0.0.1:8000/v1) [--max-tokens N]
"""
import argparse
import json

from openai import OpenAI


def collect(stream):
    text, usage, chunks, finish = [], None, 0, None
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            piece = getattr(choice, "delta", None)
            piece = piece.content if piece is not None else getattr(choice, "text", None)
            if piece:
                text.append(piece)
            if choice.finish_reason:
                finish = choice.finish_reason
    return {"text": "".join(text), "usage": usage, "chunks": chunks, "finish_reason": finish}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base_url")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--api-key", default="unused")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=120)
    models = [m.id for m in client.models.list().data]
    chat = client.chat.completions.create(
        model=models[0],
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=args.max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    completion = client.completions.create(
        model=models[0],
        prompt="The quick brown fox",
        max_tokens=args.max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    print(json.dumps({"models": models, "chat": collect(chat), "completion": collect(completion)}))


if __name__ == "__main__":
    main()
