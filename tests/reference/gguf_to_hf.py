#!/usr/bin/env python3
"""Converts a Llama GGUF into a Hugging Face directory (config.json, model.safetensors,
tokenizer.json), independently of the Rust engine, so tests can check that the engine's
safetensors path serves the same model as its GGUF path.

Weights are dequantized to float32 (so both paths see identical values) and the Q/K rows are
un-permuted back to Hugging Face order (llama.cpp's converter permutes them for interleaved RoPE).

    gguf_to_hf.py --model M.gguf --out DIR
"""
import argparse
import json
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_tokenize import build_tokenizer  # noqa: E402
from llama_ref import meta  # noqa: E402


def unpermute(w, heads):
    """Inverse of llama.cpp's `w.reshape(heads, 2, d/2, cols).swapaxes(1, 2)`."""
    rows, cols = w.shape
    hd = rows // heads
    return w.reshape(heads, hd // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    reader = GGUFReader(args.model)
    arch = meta(reader, "general.architecture")
    heads = int(meta(reader, f"{arch}.attention.head_count"))
    kv_heads = int(meta(reader, f"{arch}.attention.head_count_kv", heads))
    w = {t.name: np.ascontiguousarray(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)) for t in reader.tensors}
    n_layers = int(meta(reader, f"{arch}.block_count"))
    out = {"model.embed_tokens.weight": w["token_embd.weight"], "model.norm.weight": w["output_norm.weight"]}
    names = {
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    }
    for i in range(n_layers):
        for g, h in names.items():
            out[f"model.layers.{i}.{h}.weight"] = w[f"blk.{i}.{g}.weight"]
        out[f"model.layers.{i}.self_attn.q_proj.weight"] = np.ascontiguousarray(unpermute(w[f"blk.{i}.attn_q.weight"], heads))
        out[f"model.layers.{i}.self_attn.k_proj.weight"] = np.ascontiguousarray(unpermute(w[f"blk.{i}.attn_k.weight"], kv_heads))
    tied = "output.weight" not in w
    if not tied:
        out["lm_head.weight"] = w["output.weight"]
    os.makedirs(args.out, exist_ok=True)
    save_file(out, os.path.join(args.out, "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": int(meta(reader, f"{arch}.embedding_length")),
        "intermediate_size": int(meta(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": int(w["token_embd.weight"].shape[0]),
        "rope_theta": float(meta(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(meta(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(meta(reader, f"{arch}.context_length")),
        "tie_word_embeddings": tied,
        "bos_token_id": int(meta(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(meta(reader, "tokenizer.ggml.eos_token_id", 2)),
        "torch_dtype": "float32",
    }
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    build_tokenizer(args.model).save(os.path.join(args.out, "tokenizer.json"))
    print(json.dumps({"out": args.out, "tensors": len(out)}))


if __name__ == "__main__":
    main()
