"""Builds the model and fills its weights: HF safetensors directory, GGUF file, or dummy."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from engine.attention import KernelSet
from engine.config import ModelConfig
from engine.kv_scales import is_kv_scale
from engine.models import model_class
from engine.models.llama import LlamaForCausalLM
from engine.parallel.group import TPGroup

# hf name -> (dim, start, stop) this rank reads, or None for the whole tensor
Slicer = Callable[[str], "tuple[int, int, int] | None"]

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


def _safetensors(path: str, slicer: Slicer) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor, or only the rows/columns `slicer` names (a TP rank reads its part)."""
    from safetensors.torch import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {path!r}")
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                if is_kv_scale(name):  # a KV cache scale, read by engine/kv_scales.py
                    continue
                cut = slicer(name)
                if cut is None:
                    yield name, st.get_tensor(name)
                    continue
                part = st.get_slice(name)
                dim, a, b = cut
                yield name, part[a:b] if dim == 0 else part[:, a:b]


def _fill_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Small normal weights and unit norms give finite, non-degenerate logits at any size.
    The draws are TP1's, in TP1's order and shapes; a TP rank keeps its slice of each, so
    every TP size runs the same model."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.device("meta"):
        full = type(model)(model.cfg, model.kernels, 1)  # TP1 names and shapes only
    local = dict(model.named_parameters())
    with torch.no_grad():
        for i, (name, meta) in enumerate(full.named_parameters()):
            p = local[name]
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if meta.numel() < (1 << 24):
                w = torch.empty(meta.shape, dtype=torch.float32).normal_(0, 0.02, generator=gen)
            else:  # large tensors are drawn on their own device, fast on a GPU
                g = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + i)
                w = torch.empty(meta.shape, dtype=p.dtype, device=p.device)
                w.normal_(0, 0.02, generator=g)
            p.copy_(model.local_from_full(name, w))


# torch.nn.init's random fills, which nn.Linear/nn.Embedding run as they are built
_RANDOM_INITS = frozenset({
    torch.nn.init.uniform_, torch.nn.init.normal_, torch.nn.init.trunc_normal_,
    torch.nn.init.kaiming_uniform_, torch.nn.init.kaiming_normal_,
    torch.nn.init.xavier_uniform_, torch.nn.init.xavier_normal_})


class _NoRandomInit(TorchFunctionMode):
    """Leaves parameters unfilled while a model is built: build_model then overwrites every
    one (from the checkpoint, which must supply them all, or with dummy weights), so the
    random fills were wasted work: 0.6 s of SmolLM2-135M's start on CPU, on every worker
    start. torch.nn.init's functions dispatch through an active mode, hence a mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in _RANDOM_INITS:
            return args[0] if args else (kwargs or {})["tensor"]
        return func(*args, **(kwargs or {}))


def build_model(path: str, cfg: ModelConfig, kernels: KernelSet, device: torch.device,
                dtype: str, load_format: str, max_positions: int,
                seed: int = 0, group: TPGroup | None = None,
                quantization: str | None = None) -> LlamaForCausalLM:
    """group: this rank's TP group; the model then holds (and reads) only its shard.
    quantization: "fp8" (or "fp8-all": the end layers too) quantizes a float checkpoint's
    projections at load (an FP8 checkpoint, cfg.quant, needs none)."""
    from engine.quant.install import install_empty, quantize_loaded
    from engine.quant.scheme import AT_LOAD_SCHEMES

    prev = torch.get_default_dtype()
    torch.set_default_dtype(TORCH_DTYPES[dtype])
    try:
        with torch.device(device), _NoRandomInit():
            model = model_class(cfg)(cfg, kernels, max_positions, group)
    finally:
        torch.set_default_dtype(prev)
    if load_format == "dummy":
        _fill_dummy(model, seed)
        # dummy weights of an FP8 config: random floats quantized by its scheme (with
        # dynamic activation scales: random weights come with no calibrated input_scale)
        scheme = cfg.quant or (AT_LOAD_SCHEMES[quantization] if quantization else None)
        if scheme is not None:
            if scheme.act == "tensor":
                scheme = dataclasses.replace(scheme, act="token")
            quantize_loaded(model, scheme)
    else:
        if cfg.quant is not None:
            model.quant = cfg.quant
            install_empty(model, cfg.quant)
        if path.endswith(".gguf"):
            from engine.gguf_reader import iter_gguf_tensors

            used = model.load_weights(iter_gguf_tensors(path, model.wants))
        else:
            used = model.load_weights(_safetensors(path, model.wants))
        expected = {n.removeprefix("model.") for n, _ in model.named_parameters()}
        if cfg.tie_word_embeddings:
            expected.discard("lm_head.weight")
        loaded = used if cfg.is_mla else _fused_names(used)  # DeepSeek's: parameter names
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"model: checkpoint lacks weights {missing[:4]}")
        if cfg.quant is None and quantization is not None:
            quantize_loaded(model, AT_LOAD_SCHEMES[quantization])
    # layouts built from the loaded weights (fused stacks): every weight is final here
    for module in list(model.modules()):
        finish = getattr(module, "finish_load", None)
        if callable(finish):
            finish()
    if device.type == "cuda":
        # the tensors the stacks replaced: cached blocks would read as in use to the KV
        # pool's sizing (engine/memory_budget.py asks the device what is free)
        torch.cuda.empty_cache()
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
