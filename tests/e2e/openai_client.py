#!/usr/bin/env python3
"""Drives a tandem router's HTTP endpoint with the official `openai` Python package, as a
client of an OpenAI-compatible server would: a streamed chat completion and a streamed text
completion, each asking for usage in the final chunk. Prints one JSON object:

    {"chat": {"text": ..., "usage": {...}, "chunks": N}, "completion": {...}, "models": [...],
     "surface": {...}}

"surface" exercises the rest of the API through the client's own types: `n` choices with
`logprobs`/`top_logprobs`, penalties, `seed` (asked twice: the same answer), several `stop`
strings, `max_completion_tokens` and `user` (chat, not streamed); `n` with completions'
integer `logprobs`, streamed; a penalty that must change a greedy answer; and structured
output: `response_format` `json_object` and `json_schema` (streamed), and a schema the server
must refuse with a 400.

Usage: openai_client.py BASE_URL (e.g. http://127.0.0.1:8000/v1) [--max-tokens N]
"""
import argparse
import json

from openai import BadRequestError, OpenAI


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
    out = {"models": models, "chat": collect(chat), "completion": collect(completion)}
    out["surface"] = surface(client, models[0])
    print(json.dumps(out))


def surface(client, model):
    messages = [{"role": "user", "content": "Write three short sentences about the sea."}]

    def sampled():
        r = client.chat.completions.create(
            model=model, messages=messages, n=2, temperature=1.0, seed=7,
            logprobs=True, top_logprobs=2, presence_penalty=0.3, frequency_penalty=0.5,
            stop=[".", "\n\n"], max_completion_tokens=12, user="user-1",
        )
        return r

    first, again = sampled(), sampled()
    chat = {
        "texts": [c.message.content for c in first.choices],
        "again": [c.message.content for c in again.choices],
        "indices": [c.index for c in first.choices],
        "finish": [c.finish_reason for c in first.choices],
        "logprobs": [
            [(t.token, t.logprob, len(t.top_logprobs)) for t in c.logprobs.content]
            for c in first.choices
        ],
        "usage": first.usage.model_dump(),
    }
    stream = client.completions.create(
        model=model, prompt="The sea is", n=2, logprobs=1, max_tokens=6, temperature=0.9,
        seed=3, stream=True, extra_body={"ignore_eos": True},
    )
    texts, tokens = {}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.text or "")
            if c.logprobs is not None:
                tokens[c.index] = tokens.get(c.index, 0) + len(c.logprobs.tokens)
    repeat = "la la la la la la la la la la la la"

    def greedy(**kw):
        return client.completions.create(
            model=model, prompt=repeat, max_tokens=12, temperature=0, **kw
        ).choices[0].text

    return {
        "chat": chat,
        "completion": {"texts": texts, "tokens": tokens},
        "greedy": greedy(),
        "greedy_penalised": greedy(frequency_penalty=2.0),
        "structured": structured(client, model),
    }


CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 40},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 2},
    },
    "required": ["city", "population_millions", "landmarks"],
    "additionalProperties": False,
}


def structured(client, model):
    messages = [{"role": "user", "content": "Tell me about Paris."}]
    obj = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_completion_tokens=48,
        response_format={"type": "json_object"},
    ).choices[0]
    stream = client.chat.completions.create(
        model=model, messages=messages, temperature=0.7, seed=5, max_completion_tokens=96,
        stream=True,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}},
    )
    schema = collect(stream)
    try:
        client.chat.completions.create(
            model=model, messages=messages, max_completion_tokens=8,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}},
        )
        refused = None
    except BadRequestError as e:
        refused = {"status": e.status_code, "body": e.body}
    return {
        "json_object": {"text": obj.message.content, "finish_reason": obj.finish_reason},
        "json_schema": schema,
        "refused": refused,
    }


if __name__ == "__main__":
    main()
