#!/usr/bin/env python3
"""Writes a small copy of the served GGUF for the GPU machine, where at most 64 MiB travel with
the binaries and the real file is 94 MB: the first N transformer layers (default 2), the token
embedding re-quantized from Q8_0 to Q4_0, and every tokenizer and chat-template field as they
are, so the router, the HTTP API and `bench-serve` work unchanged. Its text is not meaningful; it
is for checking that `tandem up --device cuda` gives the colocated GPU engine's tokens, and for
timing the serving path, not the model.

    small_gguf.py SRC DST [--layers N]
"""
import argparse
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()

    r = GGUFReader(args.src)
    arch = r.fields["general.architecture"].contents()
    blocks = r.fields[f"{arch}.block_count"].contents()
    if not 1 <= args.layers <= blocks:
        print(f"small_gguf: --layers must be 1..{blocks}, got {args.layers}", file=sys.stderr)
        return 2
    w = GGUFWriter(args.dst, arch)
    for f in r.fields.values():
        # The writer adds the header fields and the architecture itself.
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        val = args.layers if f.name == f"{arch}.block_count" else f.contents()
        w.add_key_value(f.name, val, vtype, sub_type=sub)

    kept = 0
    for t in r.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= args.layers:
            continue
        shape = [int(x) for x in reversed(t.shape)]  # GGUF lists dims fastest first
        if t.name == "token_embd.weight" and t.tensor_type == GGMLQuantizationType.Q8_0:
            x = quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            q = quants.quantize(x, GGMLQuantizationType.Q4_0)
            w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q4_0)
        else:
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
        kept += 1

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"small_gguf: wrote {args.dst}: {args.layers} of {blocks} layers, {kept} tensors", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
