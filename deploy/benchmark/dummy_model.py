"""A weightless model directory for ``--load-format dummy`` benchmarks of a whole cluster.

Workers need only ``config.json`` with dummy weights, but the router resolves the model as
an HF directory (a ``*.safetensors`` file, ``tokenizer.json``) to tokenize and detokenize.
This writes an empty safetensors file and a word-level tokenizer with one token per id
(``t0``, ``t1``, ...), so benchmarks that send token ids work end to end on any shape.

    python -m deploy.benchmark.dummy_model DIR --preset llama3-8b
"""

from __future__ import annotations

import argparse
import json
import os
import struct
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # Meta-Llama-3-8B's shape.
    "llama3-8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
                  "rope_theta": 500000.0, "max_position_embeddings": 8192,
                  "rms_norm_eps": 1e-5, "bos_token_id": 128000, "eos_token_id": 128001},
    # The same structure at toy size, for a CPU dry run of the GPU command.
    "tiny": {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 32000,
             "rope_theta": 500000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
             "bos_token_id": 1, "eos_token_id": 2},
}


def _tokenizer_json(vocab_size: int) -> dict[str, Any]:
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "unk_token": "t0",
                      "vocab": {f"t{i}": i for i in range(vocab_size)}}}


def write_dummy_model(path: str, preset: str) -> str:
    if preset not in PRESETS:
        raise ValueError(f"--preset: expected one of {sorted(PRESETS)}, got {preset!r}")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", **PRESETS[preset]}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(_tokenizer_json(cfg["vocab_size"]), f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": f"t{cfg['eos_token_id']}"}, f)
    header = b"{}"  # a valid safetensors file holding no tensor
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    args = p.parse_args()
    print(write_dummy_model(args.path, args.preset))


if __name__ == "__main__":
    main()
