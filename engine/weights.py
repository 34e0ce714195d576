"""Builds the model and fills its weights: HF safetensors directory, GGUF file, or dummy."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch

from engine.attention import KernelSet
from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_model_config(path: str) -> ModelConfig:
    if path.endswith(".gguf"):
        from engine.gguf_reader import read_gguf_config

        return ModelConfig.from_hf(read_gguf_config(path))
    if os.path.isdir(path):
        return ModelConfig.from_dir(path)
    if path.endswith(".json"):  # a bare config.json, for --load-format dummy
        with open(path) as f:
            return ModelConfig.from_hf(json.load(f))
    raise ValueError(f"model: {path!r} is neither a model directory nor a .gguf file")


def _safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {path!r}")
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, st.get_tensor(name)


def _fill_dummy(model: torch.nn.Module, seed: int) -> None:
    # Small normal weights and unit norms give finite, non-degenerate logits at any size.
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                cpu = torch.empty(p.shape, dtype=torch.float32).normal_(0, 0.02, generator=gen) \
                    if p.numel() < (1 << 24) else None
                if cpu is not None:
                    p.copy_(cpu)
                else:  # large tensors are filled on their own device, fast on a GPU
                    p.normal_(0, 0.02)


def build_model(path: str, cfg: ModelConfig, kernels: KernelSet, device: torch.device,
                dtype: str, load_format: str, max_positions: int,
                seed: int = 0) -> LlamaForCausalLM:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(TORCH_DTYPES[dtype])
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg, kernels, max_positions)
    finally:
        torch.set_default_dtype(prev)
    if load_format == "dummy":
        _fill_dummy(model, seed)
    else:
        if path.endswith(".gguf"):
            from engine.gguf_reader import iter_gguf_tensors

            used = model.load_weights(iter_gguf_tensors(path))
        else:
            used = model.load_weights(_safetensors(path))
        expected = {n.removeprefix("model.") for n, _ in model.named_parameters()}
        if cfg.tie_word_embeddings:
            expected.discard("lm_head.weight")
        loaded = _fused_names(used)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"model: checkpoint lacks weights {missing[:4]}")
    model.eval()
    return model


def _fused_names(used: set[str]) -> set[str]:
    out = set()
    for n in used:
        for sub in ("q_proj", "k_proj", "v_proj"):
            n = n.replace(sub, "qkv_proj")
        for sub in ("gate_proj", "up_proj"):
            n = n.replace(sub, "gate_up_proj")
        out.add(n)
    return out
