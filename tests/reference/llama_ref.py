#!/usr/bin/env python3
"""Independent numpy float32 reference forward pass of a Llama-family GGUF (greedy decoding).

Written for tandem's tests and deliberately independent of the Rust engine: it reads the GGUF
with the `gguf` PyPI package, dequantizes every tensor to float32 (`gguf.quants.dequantize`),
and runs a plain Llama decoder in numpy float32:

- token embedding, tied LM head (token_embd is also the output matrix unless `output.weight`
  exists);
- RMSNorm with eps from `<arch>.attention.layer_norm_rms_epsilon`;
- GQA attention over a plain, full KV cache (query head h uses KV head h // (n_head / n_kv));
- RoPE with theta `<arch>.rope.freq_base`, applied *interleaved* (GPT-J style: pairs
  (2i, 2i+1) rotated by pos * theta^(-2i/d)) to the raw GGUF Q/K weights' outputs: GGUF
  conversion permutes the Q/K rows for exactly that layout. The Rust engine instead un-permutes
  at load and uses rotate-half; the two agree mathematically, which is what this checks;
- SiLU-gated MLP (down(silu(gate(x)) * up(x)));
- greedy argmax.

GGUF stores dims reversed relative to numpy; `dequantize` returns (rows, cols) = (out, in),
so every projection is `x @ W.T` (e.g. attn_k of a 576 -> 192 model is (192, 576)).

Usage:
    python3 llama_ref.py --model M.gguf --ids 1,2,3 --max-new 24 [--ignore-eos] [--dump-logits N]
prints one JSON line {"tokens": [generated ids only]} to stdout (plus "logits": the first N
logits of the first generated step with --dump-logits N). Generation stops after emitting the
GGUF's EOS token (`tokenizer.ggml.eos_token_id`, included in the output) unless --ignore-eos.
"""

import argparse
import json
import sys

INSTALL_HINT = "pip install -r tests/reference/requirements.txt"

try:
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
except ImportError as exc:  # pragma: no cover
    sys.stderr.write(f"missing Python package ({exc}); install with: {INSTALL_HINT}\n")
    sys.exit(3)


def meta(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise SystemExit(f"GGUF has no metadata key {key}")
        return default
    return f.contents()


class LlamaRef:
    """Weights (float32) and hyper-parameters of one GGUF Llama model."""

    def __init__(self, path):
        reader = GGUFReader(path)
        arch = meta(reader, "general.architecture")
        self.n_layers = int(meta(reader, f"{arch}.block_count"))
        self.dim = int(meta(reader, f"{arch}.embedding_length"))
        self.n_heads = int(meta(reader, f"{arch}.attention.head_count"))
        self.n_kv_heads = int(meta(reader, f"{arch}.attention.head_count_kv", self.n_heads))
        self.head_dim = self.dim // self.n_heads
        self.eps = np.float32(meta(reader, f"{arch}.attention.layer_norm_rms_epsilon"))
        self.rope_base = float(meta(reader, f"{arch}.rope.freq_base", 10000.0))
        self.eos = int(meta(reader, "tokenizer.ggml.eos_token_id", -1))
        self.w = {}
        for t in reader.tensors:
            arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            self.w[t.name] = np.ascontiguousarray(arr)
        self.lm_head = self.w.get("output.weight", self.w["token_embd.weight"])
        q = self.w["blk.0.attn_q.weight"]
        k = self.w["blk.0.attn_k.weight"]
        assert q.shape == (self.n_heads * self.head_dim, self.dim), q.shape
        assert k.shape == (self.n_kv_heads * self.head_dim, self.dim), k.shape
        half = np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim
        self.inv_freq = (self.rope_base ** -half).astype(np.float64)  # (head_dim / 2,)

    def rms_norm(self, x, weight):
        var = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
        return (x / np.sqrt(var + self.eps)) * weight

    def rope_interleaved(self, x, positions):
        """Rotate pairs (2i, 2i+1) of x: (T, heads, head_dim) at the given positions."""
        angles = np.outer(positions, self.inv_freq)  # (T, head_dim / 2), float64
        cos = np.cos(angles).astype(np.float32)[:, None, :]
        sin = np.sin(angles).astype(np.float32)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def forward(self, ids, start, k_cache, v_cache):
        """Run tokens `ids` at positions start.. and return the last position's logits."""
        t = len(ids)
        positions = np.arange(start, start + t)
        h = self.w["token_embd.weight"][np.asarray(ids)]  # (T, dim)
        group = self.n_heads // self.n_kv_heads
        scale = np.float32(1.0 / np.sqrt(self.head_dim))
        end = start + t
        # Causal mask over the cache: query i (position start+i) sees keys 0..=start+i.
        mask = np.where(np.arange(end)[None, :] <= positions[:, None], 0.0, -np.inf).astype(np.float32)
        for layer in range(self.n_layers):
            p = f"blk.{layer}."
            x = self.rms_norm(h, self.w[p + "attn_norm.weight"])
            q = (x @ self.w[p + "attn_q.weight"].T).reshape(t, self.n_heads, self.head_dim)
            k = (x @ self.w[p + "attn_k.weight"].T).reshape(t, self.n_kv_heads, self.head_dim)
            v = (x @ self.w[p + "attn_v.weight"].T).reshape(t, self.n_kv_heads, self.head_dim)
            q = self.rope_interleaved(q, positions)
            k = self.rope_interleaved(k, positions)
            k_cache[layer, start:end] = k
            v_cache[layer, start:end] = v
            keys = k_cache[layer, :end]  # (S, n_kv, hd)
            values = v_cache[layer, :end]
            attn = np.empty((t, self.n_heads, self.head_dim), dtype=np.float32)
            for head in range(self.n_heads):
                kv = head // group
                scores = (q[:, head, :] @ keys[:, kv, :].T) * scale + mask  # (T, S)
                scores = scores - scores.max(axis=-1, keepdims=True)
                probs = np.exp(scores)
                probs /= probs.sum(axis=-1, keepdims=True)
                attn[:, head, :] = probs @ values[:, kv, :]
            h = h + attn.reshape(t, self.dim) @ self.w[p + "attn_output.weight"].T
            x = self.rms_norm(h, self.w[p + "ffn_norm.weight"])
            gate = x @ self.w[p + "ffn_gate.weight"].T
            up = x @ self.w[p + "ffn_up.weight"].T
            act = gate / (np.float32(1.0) + np.exp(-gate)) * up
            h = h + act @ self.w[p + "ffn_down.weight"].T
        last = self.rms_norm(h[-1:], self.w["output_norm.weight"])
        return (last @ self.lm_head.T)[0]

    def generate(self, prompt, max_new, stop_at_eos=True):
        total = len(prompt) + max_new
        shape = (self.n_layers, total, self.n_kv_heads, self.head_dim)
        k_cache = np.zeros(shape, dtype=np.float32)
        v_cache = np.zeros(shape, dtype=np.float32)
        logits = self.forward(prompt, 0, k_cache, v_cache)
        first_logits = logits
        out = []
        pos = len(prompt)
        for _ in range(max_new):
            nxt = int(np.argmax(logits))
            out.append(nxt)
            if stop_at_eos and nxt == self.eos:
                break
            if len(out) == max_new:
                break
            logits = self.forward([nxt], pos, k_cache, v_cache)
            pos += 1
        return out, first_logits


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="path to the GGUF file")
    ap.add_argument("--ids", required=True, help="prompt token ids, comma-separated")
    ap.add_argument("--max-new", type=int, default=24, help="tokens to generate")
    ap.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    ap.add_argument("--dump-logits", type=int, default=0, metavar="N",
                    help="also print the first N logits of the first generated step")
    args = ap.parse_args()

    prompt = [int(x) for x in args.ids.split(",") if x.strip()]
    if not prompt:
        raise SystemExit("--ids must name at least one token")
    model = LlamaRef(args.model)
    vocab = model.lm_head.shape[0]
    if any(i < 0 or i >= vocab for i in prompt):
        raise SystemExit(f"--ids must be in 0..{vocab}")
    tokens, first_logits = model.generate(prompt, args.max_new, stop_at_eos=not args.ignore_eos)
    result = {"tokens": tokens}
    if args.dump_logits > 0:
        result["logits"] = [float(x) for x in first_logits[: args.dump_logits]]
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
