"""Frozen, typed configuration: what the model is (ModelConfig) and how the engine runs it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from engine.cuda_probe import has_cuda
from engine.sim_config import SimConfig

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROLES = ("colocated", "producer", "consumer")
DTYPES = ("float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape, read from an HF config.json (or built from GGUF metadata)."""

    arch: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # qkv projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before rope (Qwen3)
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # HF rope_scaling dict, frozen
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
        if arch is None:
            raise ValueError(
                f"model: architecture {archs!r} is not supported "
                f"(supported: {sorted(SUPPORTED_ARCHS)})"
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        scaling = cfg.get("rope_scaling") or None
        theta = cfg.get("rope_theta")
        params = cfg.get("rope_parameters")  # transformers 5 nests rope settings here
        if isinstance(params, dict):
            theta = theta or params.get("rope_theta")
            if params.get("rope_type", "default") != "default":
                scaling = scaling or params
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        return ModelConfig(
            arch=arch,
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta or 10000.0),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True)
            else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @staticmethod
    def from_dir(path: str) -> ModelConfig:
        with open(os.path.join(path, "config.json")) as f:
            return ModelConfig.from_hf(json.load(f))


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs. Bad values raise ValueError naming the flag."""

    model: str | None = None  # None / "smollm2" = embedded SmolLM2-135M-Instruct; a dir; a .gguf
    dtype: str = "float32"
    device: str = "cpu"
    role: str = "colocated"  # "colocated" | "producer" | "consumer"
    load_format: str = "auto"  # "auto" (weights from the model source) | "dummy" (random)
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None: derived from kv_cache_bytes
    kv_cache_bytes: int = 512 << 20
    max_model_len: int | None = None  # None: min(model's max positions, 8192)
    max_num_seqs: int = 64  # running requests per step
    max_num_batched_tokens: int = 512  # per-step token budget (prefill chunks + decodes)
    max_waiting: int = 1024  # bounded waiting queue; past it add_request raises QueueFull
    seed: int = 0  # draws the seed of requests that give none
    defer_output: bool | None = None  # None: by role; set only to compare modes in benchmarks
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps
    # Keep full prompt blocks' KV after their requests end, keyed by a hash chain, and skip
    # computing a prefix found there (engine/prefix_cache.py); tokens are the same either way.
    enable_prefix_caching: bool = True
    # Fraction of the device's memory for weights, activations, graphs and KV; the KV pool
    # gets what is left (CUDA only; None: the pool is kv_cache_bytes / num_kv_blocks).
    gpu_memory_utilization: float | None = None
    # Ranks of one engine (heads, MLP columns and vocabulary split over them; rank 0 is
    # this process and schedules, the others are processes it spawns).
    tensor_parallel_size: int = 1
    devices: tuple[str, ...] | None = None  # one per rank; None: consecutive from `device`
    tp_timeout_s: float = 60.0  # bound on any one collective (a hung rank fails the engine)
    # A simulated engine: no model, timed steps, hashed tokens (engine/sim_runner.py)
    simulate: SimConfig | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # "auto": CUDA and bfloat16 when a GPU is present, else CPU and float32.
        if self.device == "auto":
            object.__setattr__(self, "device", "cuda" if has_cuda() else "cpu")
        if self.dtype == "auto":
            object.__setattr__(self, "dtype",
                               "bfloat16" if self.device.startswith("cuda") else "float32")
        if self.devices is not None and not isinstance(self.devices, tuple):
            object.__setattr__(self, "devices", tuple(self.devices))
        checks = [
            ("device", self.device == "cpu" or self.device.startswith("cuda"),
             "must be 'auto', 'cpu' or 'cuda[:N]'"),
            ("dtype", self.dtype in DTYPES, f"must be one of {DTYPES}"),
            ("role", self.role in ROLES, f"must be one of {ROLES}"),
            ("load_format", self.load_format in LOAD_FORMATS, f"must be one of {LOAD_FORMATS}"),
            ("block_size", self.block_size >= 1, "must be >= 1"),
            ("num_kv_blocks", self.num_kv_blocks is None or self.num_kv_blocks >= 1,
             "must be >= 1"),
            ("kv_cache_bytes", self.kv_cache_bytes >= 1, "must be >= 1"),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 1,
             "must be >= 1"),
            ("max_num_seqs", self.max_num_seqs >= 1, "must be >= 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, "must be >= 1"),
            ("max_waiting", self.max_waiting >= 1, "must be >= 1"),
            ("gpu_memory_utilization", self.gpu_memory_utilization is None
             or 0 < self.gpu_memory_utilization <= 1, "must be in (0, 1]"),
            ("gpu_memory_utilization", self.gpu_memory_utilization is None
             or self.device.startswith("cuda"), "needs a CUDA device"),
            ("tensor_parallel_size", self.tensor_parallel_size >= 1,
             "(--tensor-parallel-size) must be >= 1"),
            ("devices", self.devices is None or (len(self.devices) >= 1 and all(
                d == "cpu" or d.startswith("cuda") for d in self.devices)),
             "(--devices) must list 'cpu' or 'cuda[:N]' devices"),
            ("tp_timeout_s", self.tp_timeout_s > 0, "must be > 0"),
            ("enable_prefix_caching", isinstance(self.enable_prefix_caching, bool),
             "(--enable-prefix-caching) must be True or False"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

    @property
    def defers_output(self) -> bool:
        """Producer never defers (docs/architecture.md); consumer and colocated do."""
        if self.defer_output is not None:
            return self.defer_output
        return self.role != "producer"


def resolve_max_model_len(config: EngineConfig, m: ModelConfig) -> int:
    """The engine's max_model_len: the flag, within what the model can attend over."""
    limit = m.max_position_embeddings
    if m.sliding_window:
        limit = min(limit, m.sliding_window)  # no sliding-window attention: stay inside it
    if config.max_model_len is None:
        return min(limit, 8192)
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len: {config.max_model_len} exceeds the model's limit "
                         f"({limit})")
    return config.max_model_len
