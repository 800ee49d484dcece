#!/usr/bin/env python3
"""Tokenize strings with Hugging Face `tokenizers`, built from a GGUF's embedded vocabulary.

Independent reference for tandem's Rust tokenizer (engine/src/tokenizer/). It reads
`tokenizer.ggml.{tokens,merges,token_type}` with the `gguf` package and assembles the same
tokenizer SmolLM2 ships as tokenizer.json: BPE over the vocab/merges, pre-tokenizer
Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)],
ByteLevel decoder, and the control tokens (token_type 3) as special added tokens.

Usage:
    echo '["Hello world", "12345"]' | python3 hf_tokenize.py --model M.gguf
        -> prints one JSON line: [[ids of string 1], [ids of string 2], ...]
    python3 hf_tokenize.py --model M.gguf --save-json out/tokenizer.json
        -> also writes the assembled tokenizer.json (input on stdin is then optional)
    python3 hf_tokenize.py --model M.gguf --decode < ids.json
        -> input is a JSON list of id lists; prints the decoded strings as a JSON list

Exit status 3 with the pip command on stderr when numpy/gguf/tokenizers are missing.
"""

import argparse
import json
import sys

INSTALL_HINT = "pip install -r tests/reference/requirements.txt"

try:
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
except ImportError as exc:  # pragma: no cover - exercised by the Rust test's failure path
    sys.stderr.write(f"missing Python package ({exc}); install with: {INSTALL_HINT}\n")
    sys.exit(3)

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        raise SystemExit(f"GGUF has no metadata key {key}")
    return f.contents()


def pre_tokenizer_for(pre_name):
    """The HF pre-tokenizer matching llama.cpp's `tokenizer.ggml.pre` name."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_name in ("smollm", "starcoder"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre_name in (None, "gpt-2", "gpt2"):
        return byte_level
    raise SystemExit(f"hf_tokenize.py does not know pre-tokenizer {pre_name!r}")


def build_tokenizer(model_path):
    reader = GGUFReader(model_path)
    if field(reader, "tokenizer.ggml.model") != "gpt2":
        raise SystemExit("only byte-level BPE (tokenizer.ggml.model = gpt2) is supported")
    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]
    types = field(reader, "tokenizer.ggml.token_type")
    pre_name = field(reader, "tokenizer.ggml.pre") if "tokenizer.ggml.pre" in reader.fields else None

    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizer_for(pre_name)
    tok.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(tokens[i], special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)
        for i, ty in enumerate(types)
        if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    tok.add_special_tokens(specials)
    for t in specials:  # added tokens must keep their GGUF ids
        assert tok.token_to_id(t.content) == vocab[t.content], t.content
    return tok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="path to the GGUF file")
    ap.add_argument("--save-json", help="also write the assembled tokenizer.json here")
    ap.add_argument("--decode", action="store_true", help="decode JSON id lists instead of encoding")
    args = ap.parse_args()

    tok = build_tokenizer(args.model)
    if args.save_json:
        tok.save(args.save_json)
    raw = sys.stdin.read() if not sys.stdin.isatty() else ""
    if not raw.strip():
        if args.save_json:
            return
        raise SystemExit("expected a JSON list on stdin")
    items = json.loads(raw)
    if args.decode:
        out = [tok.decode(ids, skip_special_tokens=False) for ids in items]
    else:
        out = [tok.encode(s, add_special_tokens=False).ids for s in items]
    sys.stdout.write(json.dumps(out, ensure_ascii=True) + "\n")


if __name__ == "__main__":
    main()
