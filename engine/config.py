"""Frozen, typed configuration: what the model is (ModelConfig) and how the engine runs it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from engine.cuda_probe import has_cuda
from engine.quant.scheme import QUANTIZATION_FLAGS, Fp8Scheme, scheme_from_hf
from engine.sim_config import SimConfig

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
ROLES = ("colocated", "producer", "consumer")
# What each role means to the engine, as the flags it reads (it never tests a role's name):
# prefill_only, a request stops after token 0 and keeps its blocks for the transfer;
# defer_output, overlap scheduling (docs/architecture.md: a producer never defers).
ROLE_FLAGS: dict[str, dict[str, bool]] = {
    "colocated": {"prefill_only": False, "defer_output": True},
    "producer": {"prefill_only": True, "defer_output": False},
    "consumer": {"prefill_only": False, "defer_output": True},
}
DTYPES = ("float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
KV_CACHE_DTYPES = ("auto", "fp8")  # fp8: float8_e4m3fn, per-layer scales (engine/kv_scales)
SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: which layers have one, how tokens are routed (as
    engine/models/moe.select_experts computes it) and the experts' shape."""

    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts per token
    intermediate_size: int  # one expert's gate/up width
    layers: tuple[int, ...]  # decoder layers whose MLP is this MoE (others are dense)
    renormalize: bool  # top-k weights divided by their sum
    scoring_func: str = "softmax"  # "softmax" | "sigmoid" (DeepSeek-V3)
    n_group: int | None = None  # grouped top-k: experts split in n_group groups ...
    topk_group: int | None = None  # ... of which the best topk_group are eligible
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights
    score_bias: bool = False  # e_score_correction_bias added to scores for choice only
    n_shared_experts: int = 0  # always-on experts beside the routed ones (one fused MLP)
    shared_intermediate_size: int = 0  # the shared MLP's width (all shared experts)
    router_fp32: bool = False  # router logits computed in float32 (DeepSeek)
    # top-k weights rounded to the model's dtype before they scale the experts (Qwen3-MoE,
    # as transformers does; Mixtral and DeepSeek keep them float32)
    weights_in_model_dtype: bool = False

    def __post_init__(self) -> None:
        checks = [
            ("num_experts", self.num_experts >= 1, "must be >= 1"),
            ("num_experts_per_tok", 1 <= self.top_k <= self.num_experts,
             f"must be in [1, {self.num_experts}]"),
            ("moe_intermediate_size", self.intermediate_size >= 1, "must be >= 1"),
            ("scoring_func", self.scoring_func in SCORING_FUNCS,
             f"must be one of {SCORING_FUNCS}"),
            ("n_group", self.n_group is None or (self.n_group >= 1
                                                  and self.num_experts % self.n_group == 0),
             f"must divide the {self.num_experts} experts"),
            ("topk_group", (self.n_group is None) == (self.topk_group is None)
             and (self.topk_group is None or 1 <= self.topk_group <= (self.n_group or 0)),
             "must be given with n_group and lie in [1, n_group]"),
            ("routed_scaling_factor", self.routed_scaling_factor > 0, "must be > 0"),
            ("n_shared_experts", self.n_shared_experts >= 0, "must be >= 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"model: {name} {why}")
        if self.n_group is not None and self.topk_group is not None:
            per_group = self.num_experts // self.n_group
            if self.top_k > self.topk_group * per_group:
                raise ValueError("model: num_experts_per_tok exceeds the experts of topk_group "
                                 "groups")


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape, read from an HF config.json (or built from GGUF metadata)."""

    arch: str  # a SUPPORTED_ARCHS value: "llama" | "mistral" | "qwen2" | "qwen3" | ...
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
    moe: MoEConfig | None = None  # mixture-of-experts MLPs (None: every layer dense)
    # ---- DeepSeek-V2/V3's multi-head latent attention (engine/models/mla.py), when
    # kv_lora_rank > 0; the defaults describe no MLA, so other archs never read them.
    q_lora_rank: int | None = None  # None: q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int = 0  # latent width the KV cache stores per token (0: not MLA)
    qk_nope_head_dim: int = 0  # per-head query/key dims without RoPE (through kv_b_proj)
    qk_rope_head_dim: int = 0  # per-head query dims with RoPE; the key's are shared by heads
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE pairs are (x0, x1), (x2, x3)...: DeepSeek's layout
    # FP8 weights of the checkpoint (its quantization_config); None: float weights
    quant: Fp8Scheme | None = None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

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
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"model: hidden_act {cfg.get('hidden_act')!r} is not supported "
                             "(only 'silu')")
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
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True)
            else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=moe_config_from_hf(cfg, arch),
        )
        if arch.startswith("deepseek"):  # MLA fields, and what they override
            base.update(_deepseek_fields(arch, cfg, scaling))
        base["quant"] = scheme_from_hf(cfg)
        return ModelConfig(**base)

    @staticmethod
    def from_dir(path: str) -> ModelConfig:
        with open(os.path.join(path, "config.json")) as f:
            return ModelConfig.from_hf(json.load(f))


def moe_config_from_hf(cfg: dict[str, Any], arch: str) -> MoEConfig | None:
    """The MoE fields of an HF config; None for a dense architecture. Training-only fields
    (router aux loss, router jitter, output_router_logits) change nothing at inference."""
    layers = int(cfg["num_hidden_layers"])
    # absent fields take transformers' defaults, as HF itself would run the config
    if arch == "qwen3_moe":
        n = cfg.get("num_experts", cfg.get("num_local_experts", 128))
        step = int(cfg.get("decoder_sparse_step", 1))
        if step < 1:
            raise ValueError(f"model: decoder_sparse_step must be >= 1, got {step}")
        dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
        sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        if not n or not sparse:  # HF builds every layer dense then
            return None
        return MoEConfig(
            num_experts=int(n), top_k=int(cfg.get("num_experts_per_tok", 8)),
            intermediate_size=int(cfg.get("moe_intermediate_size", 768)), layers=sparse,
            renormalize=bool(cfg.get("norm_topk_prob", False)), weights_in_model_dtype=True)
    if arch == "mixtral":
        return MoEConfig(
            num_experts=int(cfg.get("num_local_experts", 8)),
            top_k=int(cfg.get("num_experts_per_tok", 2)),
            intermediate_size=int(cfg.get("intermediate_size", 14336)),
            layers=tuple(range(layers)),
            renormalize=True)  # Mixtral always renormalizes its top-k
    if arch in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_moe(cfg, arch, layers)
    return None


def _deepseek_moe(cfg: dict[str, Any], arch: str, layers: int) -> MoEConfig | None:
    """DeepSeek-V2/V3's MoE as transformers runs it: layers from first_k_dense_replace on;
    V2 softmax top-k (greedy or group_limited_greedy), V3 sigmoid scores with
    e_score_correction_bias and grouped top-k (noaux_tc); routed experts scaled by
    routed_scaling_factor; n_shared_experts always-on experts of moe_intermediate_size."""
    n = cfg.get("n_routed_experts")
    if not n:
        return None
    freq = int(cfg.get("moe_layer_freq", 1))
    if freq != 1:  # DeepSeek's own code honours it, transformers does not: no one answer
        raise ValueError(f"model: moe_layer_freq {freq} is not supported (only 1)")
    first = int(cfg.get("first_k_dense_replace") or 0)
    inter = int(cfg.get("moe_intermediate_size", 1407 if arch == "deepseek_v2" else 2048))
    shared = int(cfg.get("n_shared_experts") or 0)
    common: dict[str, Any] = dict(
        num_experts=int(n), top_k=int(cfg.get("num_experts_per_tok") or 0),
        intermediate_size=inter, layers=tuple(range(first, layers)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor",
                                            1.0 if arch == "deepseek_v2" else 2.5)),
        n_shared_experts=shared, shared_intermediate_size=inter * shared, router_fp32=True)
    method = cfg.get("topk_method") or ("greedy" if arch == "deepseek_v2" else "noaux_tc")
    scoring = cfg.get("scoring_func") or ("softmax" if arch == "deepseek_v2" else "sigmoid")
    if arch == "deepseek_v2":
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"model: topk_method {method!r} is not supported for "
                             "DeepSeek-V2 (greedy, group_limited_greedy)")
        if scoring != "softmax":
            raise ValueError(f"model: scoring_func {scoring!r} is not supported for "
                             "DeepSeek-V2 (softmax)")
        if cfg.get("norm_topk_prob"):  # DeepSeek's code applies it, transformers drops it
            raise ValueError("model: norm_topk_prob true is not supported for DeepSeek-V2")
        grouped = method == "group_limited_greedy"
        return MoEConfig(**common, renormalize=False, scoring_func="softmax",
                         n_group=int(cfg["n_group"]) if grouped else None,
                         topk_group=int(cfg["topk_group"]) if grouped else None)
    if method != "noaux_tc":
        raise ValueError(f"model: topk_method {method!r} is not supported for DeepSeek-V3 "
                         "(noaux_tc)")
    if scoring != "sigmoid":
        raise ValueError(f"model: scoring_func {scoring!r} is not supported for DeepSeek-V3 "
                         "(sigmoid)")
    return MoEConfig(**common, renormalize=bool(cfg.get("norm_topk_prob", True)),
                     scoring_func="sigmoid", n_group=int(cfg.get("n_group") or 1),
                     topk_group=int(cfg.get("topk_group") or 1), score_bias=True)


def _deepseek_fields(arch: str, cfg: dict[str, Any],
                     scaling: dict[str, Any] | None) -> dict[str, Any]:
    """ModelConfig's MLA fields from a DeepSeek config (its MoE is _deepseek_moe's);
    ValueError names any field whose value the engine does not implement (never silently
    ignored). Semantics are transformers' (models/deepseek_v2|deepseek_v3)."""

    def refuse(name: str, why: str) -> ValueError:
        return ValueError(f"{name}: {why}, got {cfg.get(name)!r}")

    for name in ("attention_bias", "mlp_bias"):
        if cfg.get(name):
            raise refuse(name, "biases on DeepSeek projections are not implemented")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "yarn":
        raise ValueError(f"rope_scaling: DeepSeek supports 'yarn' only, got {scaling!r}")
    q_lora = cfg.get("q_lora_rank")
    checks = [
        ("kv_lora_rank", int(cfg["kv_lora_rank"]) >= 1, "must be >= 1"),
        ("q_lora_rank", q_lora is None or int(q_lora) >= 1, "must be >= 1 or null"),
        ("qk_rope_head_dim", int(cfg["qk_rope_head_dim"]) >= 2
         and int(cfg["qk_rope_head_dim"]) % 2 == 0, "must be even and >= 2"),
        ("qk_nope_head_dim", int(cfg["qk_nope_head_dim"]) >= 1, "must be >= 1"),
        ("v_head_dim", int(cfg["v_head_dim"]) >= 1, "must be >= 1"),
    ]
    for name, ok, why in checks:
        if not ok:
            raise refuse(name, why)
    return dict(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        # V2 rotates (x0, x1) pairs as complex numbers; V3 has the flag (default on)
        rope_interleave=bool(cfg.get("rope_interleave", True)) if arch == "deepseek_v3"
        else True,
        # what the shared dense code reads: the query/key head (memory estimates) and all
        # heads as "KV heads" (TP checks); the cache itself is the latent (kv_layout)
        head_dim=int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"]),
        num_kv_heads=int(cfg["num_attention_heads"]),
    )


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
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8": float8_e4m3fn + scales
    max_model_len: int | None = None  # None: min(model's max positions, 8192)
    max_num_seqs: int = 64  # running requests per step
    max_num_batched_tokens: int = 512  # per-step token budget (prefill chunks + decodes)
    max_waiting: int = 1024  # bounded waiting queue; past it add_request raises QueueFull
    seed: int = 0  # draws the seed of requests that give none
    defer_output: bool | None = None  # None: by role; set only to compare modes in benchmarks
    prefill_only: bool | None = None  # None: by role (ROLE_FLAGS)
    enforce_eager: bool = False  # True: no CUDA graphs (decode steps, short prefill steps)
    # One request's prefill chunks of at most this many tokens replay CUDA graphs too
    # (engine/prefill_graphs.py), wherever decode steps do; 0: prefill always runs eagerly
    prefill_graph_max_tokens: int = 256
    # Before serving, run a few requests through every prefill path so Triton compiles their
    # kernels at start-up, not on the first requests (engine/warmup.py; CUDA engines only).
    warmup: bool = True
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
    data_parallel_size: int = 1  # attention groups among the ranks (parallel/dp_groups.py)
    # A simulated engine: no model, timed steps, hashed tokens (engine/sim_runner.py)
    simulate: SimConfig | None = None
    # "fp8": a float checkpoint's dense projections quantized at load (per-channel weight
    # scales, activations per token); None: as the checkpoint is
    quantization: str | None = None
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
            ("kv_cache_dtype", self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"(--kv-cache-dtype) must be one of {KV_CACHE_DTYPES}"),
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
            ("data_parallel_size", self.data_parallel_size >= 1 and self.tensor_parallel_size
             % self.data_parallel_size == 0, "(--data-parallel-size) must divide the TP size"),
            ("quantization", self.quantization is None
             or self.quantization in QUANTIZATION_FLAGS,
             f"(--quantization) must be one of {QUANTIZATION_FLAGS} or None"),
            ("enable_prefix_caching", isinstance(self.enable_prefix_caching, bool),
             "(--enable-prefix-caching) must be True or False"),
            ("prefill_graph_max_tokens", self.prefill_graph_max_tokens >= 0,
             "(--prefill-graph-max-tokens) must be >= 0"),
            ("warmup", isinstance(self.warmup, bool), "(--no-warmup) must be True or False"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

    @property
    def kv_dtype(self) -> str:
        """The KV pool's element dtype (a torch dtype's name)."""
        return "float8_e4m3fn" if self.kv_cache_dtype == "fp8" else self.dtype

    @property
    def defers_output(self) -> bool:
        """Producer never defers (docs/architecture.md); consumer and colocated do."""
        if self.defer_output is not None:
            return self.defer_output
        return ROLE_FLAGS[self.role]["defer_output"]

    @property
    def prefills_only(self) -> bool:
        """Requests stop after token 0 and hold their blocks for the transfer (producer)."""
        if self.prefill_only is not None:
            return self.prefill_only
        return ROLE_FLAGS[self.role]["prefill_only"]


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
