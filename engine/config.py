"""Frozen, typed configuration: what the model is (ModelConfig) and how the engine runs it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from engine.cuda_probe import has_cuda

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
ROLES = ("colocated", "producer", "consumer")
DTYPES = ("float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape, read from an HF config.json (or built from GGUF metadata)."""

    arch: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "deepseek_v2" | "deepseek_v3"
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
    # ---- DeepSeek-V2/V3: MLA attention (kv_lora_rank > 0) and its MoE (engine/models/
    # deepseek.py); the defaults describe a dense model, so other archs never read them.
    q_lora_rank: int | None = None  # None: q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int = 0  # latent width the KV cache stores per token (0: not MLA)
    qk_nope_head_dim: int = 0  # per-head query/key dims without RoPE (through kv_b_proj)
    qk_rope_head_dim: int = 0  # per-head query dims with RoPE; the key's are shared by heads
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE pairs are (x0, x1), (x2, x3)...: DeepSeek's layout
    first_k_dense_replace: int = 0  # layers [0, k) use the dense MLP
    moe_layer_freq: int = 1  # from layer k on, every moe_layer_freq-th layer is MoE
    n_routed_experts: int = 0  # 0: every layer is dense
    n_shared_experts: int = 0  # always-on experts beside the routed ones (one fused MLP)
    num_experts_per_tok: int = 0
    n_group: int = 1  # expert groups for grouped top-k
    topk_group: int = 1  # groups a token may route into
    topk_method: str = "greedy"  # "greedy" | "group_limited_greedy" | "noaux_tc"
    scoring_func: str = "softmax"  # "softmax" | "sigmoid" (with e_score_correction_bias)
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False  # renormalize the top-k weights to sum to one
    moe_intermediate_size: int = 0  # per routed expert (shared: times n_shared_experts)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer: int) -> bool:
        """DeepSeek's rule: dense below first_k_dense_replace, then every moe_layer_freq-th."""
        return (self.n_routed_experts > 0 and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

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
        extra = _deepseek_fields(arch, cfg, scaling) if arch.startswith("deepseek") else {}
        base: dict[str, Any] = dict(
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
        return ModelConfig(**{**base, **extra})

    @staticmethod
    def from_dir(path: str) -> ModelConfig:
        with open(os.path.join(path, "config.json")) as f:
            return ModelConfig.from_hf(json.load(f))


def _deepseek_fields(arch: str, cfg: dict[str, Any],
                     scaling: dict[str, Any] | None) -> dict[str, Any]:
    """ModelConfig's MLA and MoE fields from a DeepSeek config; ValueError names any field
    whose value the engine does not implement (never silently ignored). Semantics are
    transformers' (models/deepseek_v2|deepseek_v3), the reference the tests compare to."""
    v3 = arch == "deepseek_v3"

    def refuse(name: str, why: str) -> ValueError:
        return ValueError(f"{name}: {why}, got {cfg.get(name)!r}")

    if cfg.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", "only 'silu' is implemented")
    for name in ("attention_bias", "mlp_bias"):
        if cfg.get(name):
            raise refuse(name, "biases on DeepSeek projections are not implemented")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "yarn":
        raise ValueError(f"rope_scaling: DeepSeek supports 'yarn' only, got {scaling!r}")
    n_routed = int(cfg.get("n_routed_experts") or 0)
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    # transformers' V3 router is always sigmoid + noaux_tc, its V2 router always softmax
    # with greedy or group-limited top-k; other combinations have no reference to match.
    if v3 and method != "noaux_tc":
        raise refuse("topk_method", "DeepseekV3 implements 'noaux_tc' only")
    if v3 and scoring != "sigmoid":
        raise refuse("scoring_func", "DeepseekV3 implements 'sigmoid' only")
    if not v3 and method not in ("greedy", "group_limited_greedy"):
        raise refuse("topk_method", "DeepseekV2 implements 'greedy' and "
                     "'group_limited_greedy'")
    if not v3 and scoring != "softmax":
        raise refuse("scoring_func", "DeepseekV2 implements 'softmax' only")
    if not v3 and cfg.get("norm_topk_prob"):  # transformers' V2 router never renormalizes
        raise refuse("norm_topk_prob", "DeepseekV2 does not renormalize top-k weights")
    n_group = int(cfg.get("n_group") or 1)
    topk_group = int(cfg.get("topk_group") or n_group)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    q_lora = cfg.get("q_lora_rank")
    out: dict[str, Any] = dict(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        # V2 rotates (x0, x1) pairs as complex numbers; V3 has the flag (default on)
        rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
        moe_layer_freq=freq,
        n_routed_experts=n_routed,
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        topk_method=method,
        scoring_func=scoring,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
        # what the shared dense code reads: the query/key head (memory estimates) and all
        # heads as "KV heads" (TP checks); the cache itself is the latent (kv_layout)
        head_dim=int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"]),
        num_kv_heads=int(cfg["num_attention_heads"]),
    )
    checks = [
        ("kv_lora_rank", out["kv_lora_rank"] >= 1, "must be >= 1"),
        ("q_lora_rank", q_lora is None or out["q_lora_rank"] >= 1, "must be >= 1 or null"),
        ("qk_rope_head_dim", out["qk_rope_head_dim"] >= 2 and out["qk_rope_head_dim"] % 2 == 0,
         "must be even and >= 2"),
        ("qk_nope_head_dim", out["qk_nope_head_dim"] >= 1, "must be >= 1"),
        ("v_head_dim", out["v_head_dim"] >= 1, "must be >= 1"),
        ("moe_layer_freq", freq >= 1, "must be >= 1"),
        ("num_experts_per_tok", n_routed == 0 or 1 <= top_k <= n_routed,
         "must be in [1, n_routed_experts]"),
        ("moe_intermediate_size", n_routed == 0 or out["moe_intermediate_size"] >= 1,
         "must be >= 1"),
        ("n_group", n_routed == 0 or (n_group >= 1 and n_routed % n_group == 0),
         "must divide n_routed_experts"),
        ("topk_group", 1 <= topk_group <= n_group, "must be in [1, n_group]"),
    ]
    for name, ok, why in checks:
        if not ok:
            raise refuse(name, why)
    return out


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
    # Fraction of the device's memory for weights, activations, graphs and KV; the KV pool
    # gets what is left (CUDA only; None: the pool is kv_cache_bytes / num_kv_blocks).
    gpu_memory_utilization: float | None = None
    # Ranks of one engine (heads, MLP columns and vocabulary split over them; rank 0 is
    # this process and schedules, the others are processes it spawns).
    tensor_parallel_size: int = 1
    devices: tuple[str, ...] | None = None  # one per rank; None: consecutive from `device`
    tp_timeout_s: float = 60.0  # bound on any one collective (a hung rank fails the engine)
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
