"""Kernels per layer of a DeepSeek or Qwen3-MoE decode (or prefill) step, counted on CPU.

At batch 1 in a CUDA graph every kernel costs a few microseconds however little it does,
so a layer's step time follows its kernel count. This runs one decode step of a small
DeepSeek-V2/V3 or Qwen3-MoE model (transformers' config class, dummy weights) with the
engine's CUDA kernel set executing under Triton's interpreter, and counts per layer:

- `triton`: Triton kernel launches (every launch, named by its kernel function);
- `aten`: torch operators outside those launches that run a kernel on a GPU: views (a
  reshape or contiguous that returns its input's storage), metadata and allocation
  (`empty*`) are left out, as they launch nothing.

Their sum per layer is the number to cut. The layout the counts come from is the engine's
real CUDA path (kernels_for(cuda)), only run by the interpreter instead of a GPU.

`--prefill N` counts one request's N-token prefill instead, planned on the host as the
engine's eager prefill steps are (MLA then decompresses the request's own blocks). A
prefill is not graphed: each launch there also costs the host its Python launch path,
which shows as gaps between the kernels where the host falls behind.

    python bench/decode_op_count.py --version v2 --batch 1
    python bench/decode_op_count.py --version v2 --prefill 600
    python bench/decode_op_count.py --version qwen3 --batch 1   # Qwen3-MoE's GQA layout
    python bench/decode_op_count.py --version v2 --context 200 --block-size 16 \
        --set engine.models.moe.ROUTER_ROUTE_FUSED=True   # a switch on (repeat --set)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

# read when @triton.jit functions are defined: set before any kernels.triton_* import
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a small model with the V2-Lite layout: no q LoRA, 1 dense then MoE layers with 2 shared
# experts, ungrouped softmax top-k; "v3": q LoRA, grouped sigmoid routing with a bias
SMALL: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    vocab_size=256, max_position_embeddings=512, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Qwen3-MoE's layout at the same small size: GQA with per-head q/k norms, 8 experts top-2,
# renormalized, every layer MoE, no shared experts
QWEN3: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2, pad_token_id=0)
VERSIONS: dict[str, dict[str, Any]] = {
    "v2": dict(q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1),
    "v3": dict(q_lora_rank=24, n_group=4, topk_group=2, n_shared_experts=1,
               routed_scaling_factor=2.5, norm_topk_prob=True),
    "qwen3": {},  # QWEN3 above
}

# aten operators that launch no kernel: allocation, and bookkeeping that stays on the host
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
              "detach", "detach_", "lift_fresh", "sym_size", "sym_stride", "sym_numel",
              "sym_storage_offset", "is_same_size", "_to_copy_noop"}


@dataclasses.dataclass
class LayerCount:
    """Kernels one layer (or the step's head/tail) launched."""

    triton: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    aten: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    @property
    def total(self) -> int:
        return sum(self.triton.values()) + sum(self.aten.values())


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.where = "embed"  # "embed", "layer.<i>" or "head"
        self.counts: dict[str, LayerCount] = collections.defaultdict(LayerCount)
        self.in_kernel = 0  # > 0 while a Triton launch runs (its own torch ops are not ours)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.in_kernel:
            name = func.overloadpacket.__name__
            # a view-like op (reshape, contiguous) launches a copy when it cannot alias
            if name not in _NO_KERNEL and not (func.is_view and _aliases(out, args)):
                self.counts[self.where].aten[name] += 1
        return out


def _aliases(out: Any, args: Any) -> bool:
    """out shares storage with a tensor among args (a view, no kernel)."""
    if not isinstance(out, torch.Tensor):
        return True  # split/unbind and such: tuples of views
    ptr = out.untyped_storage().data_ptr()
    return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr
               for a in args)


@contextlib.contextmanager
def _count_launches(counter: _Counter) -> Iterator[None]:
    """Counts every Triton launch (interpreted or compiled) against counter.where."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    saved = {cls: cls.run for cls in (InterpretedFunction, JITFunction)}

    def wrap(run: Any) -> Any:
        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not kwargs.get("warmup"):
                counter.counts[counter.where].triton[self.fn.__name__] += 1
            counter.in_kernel += 1
            try:
                return run(self, *args, **kwargs)
            finally:
                counter.in_kernel -= 1
        return counted

    for cls, run in saved.items():
        cls.run = wrap(run)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, run in saved.items():
            cls.run = run  # type: ignore[method-assign]


def write_config(path: str, version: str, **overrides: Any) -> str:
    """config.json of a small DeepSeek (or Qwen3-MoE) model, written by transformers' config
    class."""
    import transformers as tf

    if version == "qwen3":
        tf.Qwen3MoeConfig(**{**QWEN3, **overrides},
                          architectures=["Qwen3MoeForCausalLM"]).to_json_file(path)
        return path
    cls = tf.DeepseekV2Config if version == "v2" else tf.DeepseekV3Config
    arch = "DeepseekV2ForCausalLM" if version == "v2" else "DeepseekV3ForCausalLM"
    cls(**{**SMALL, **VERSIONS[version], **overrides},
        architectures=[arch]).to_json_file(path)
    return path


def count_decode_step(config_json: str, batch: int = 1, context: int = 9,
                      block_size: int = 4) -> dict[str, LayerCount]:
    """Kernels per layer of one decode step (batch requests, `context` tokens each after
    the step) of the model config_json describes, with dummy weights in float32."""
    from engine.attention import AttentionMetadata, kernels_for
    from engine.weights import build_model, read_model_config

    cfg = read_model_config(config_json)
    cpu = torch.device("cpu")
    # the CUDA kernel set, its Triton kernels run by the interpreter on CPU tensors
    kernels = kernels_for(torch.device("cuda"))
    # the rope table must reach the new token's position (context - 1)
    model = build_model(config_json, cfg, kernels, cpu, "float32", "dummy", max(64, context))
    per_req = -(-context // block_size)
    kv = torch.randn(batch * per_req + 1, *_block_shape(cfg, block_size)) * 0.1
    tables = torch.arange(1, batch * per_req + 1, dtype=torch.int32).view(batch, per_req)
    pos = torch.full((batch,), context - 1, dtype=torch.int64)
    slots = tables[:, (context - 1) // block_size].long() * block_size + (context - 1) % block_size
    meta = AttentionMetadata(
        slot_mapping=slots, block_tables=tables,
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32), decode_only=True,
        max_seq_len=None)  # as in a CUDA graph: no host lengths
    ids = torch.randint(3, cfg.vocab_size, (batch,))
    return _count_forward(model, ids, pos, kv, meta)


def _count_forward(model: Any, ids: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor,
                   meta: Any) -> dict[str, LayerCount]:
    """The kernels of one forward and its logits, by layer."""
    counter = _Counter()

    def enter(i: int) -> Any:
        def hook(*_: Any) -> None:
            counter.where = f"layer.{i}"
        return hook

    hooks = [layer.register_forward_pre_hook(enter(i)) for i, layer in enumerate(model.layers)]
    hooks.append(model.norm.register_forward_pre_hook(
        lambda *_: setattr(counter, "where", "head")))
    try:
        with torch.inference_mode(), _count_launches(counter), counter:
            model.compute_logits(model(ids, pos, kv, meta))
    finally:
        for h in hooks:
            h.remove()
    return dict(counter.counts)


def count_prefill_step(config_json: str, tokens: int,
                       block_size: int = 16) -> dict[str, LayerCount]:
    """Kernels per layer of one request's `tokens`-token prefill (no cached prefix), with the
    host lengths an eager planned step carries, dummy weights in float32."""
    model, ids, pos, kv, meta = prefill_inputs(config_json, tokens, block_size)
    return _count_forward(model, ids, pos, kv, meta())


def prefill_inputs(config_json: str, tokens: int, block_size: int = 16) -> tuple[Any, ...]:
    """(model, ids, pos, kv, meta) for one request's `tokens`-token prefill of the model
    config_json describes: the CUDA kernel set on CPU tensors, dummy float32 weights; meta()
    makes the step's attention metadata (a fresh one per forward: MLA caches the step's
    split on it)."""
    from engine.attention import AttentionMetadata, kernels_for
    from engine.weights import build_model, read_model_config

    cfg = read_model_config(config_json)
    cpu = torch.device("cpu")
    kernels = kernels_for(torch.device("cuda"))
    model = build_model(config_json, cfg, kernels, cpu, "float32", "dummy", 64)
    nb = -(-tokens // block_size)
    kv = torch.zeros(nb + 1, *_block_shape(cfg, block_size))
    table = torch.arange(1, nb + 1, dtype=torch.int32).view(1, nb)
    pos = torch.arange(tokens)

    def meta() -> Any:
        return AttentionMetadata(
            slot_mapping=pos + block_size, block_tables=table,
            cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32),
            seq_lens=torch.tensor([tokens], dtype=torch.int32), decode_only=False,
            max_seq_len=tokens, cu_seqlens_q_host=[0, tokens], seq_lens_host=[tokens])

    ids = torch.randint(3, cfg.vocab_size, (tokens,))
    return model, ids, pos, kv, meta


def _block_shape(cfg: Any, block_size: int) -> tuple[int, ...]:
    """One cache block: [layers, planes, block_size, heads, width] (MLA: one latent head)."""
    from engine.kv_layout import kv_shape_of

    kv = kv_shape_of(cfg)
    return (cfg.num_layers, kv["planes"], block_size, kv["num_kv_heads"], kv["head_dim"])


def summary(counts: dict[str, LayerCount]) -> dict[str, Any]:
    return {where: {"total": c.total, "triton": dict(sorted(c.triton.items())),
                    "aten": dict(sorted(c.aten.items()))} for where, c in counts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", choices=sorted(VERSIONS), default="v2")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=0,
                    help="count one request's prefill of this many tokens instead")
    ap.add_argument("--context", type=int, default=9,
                    help="decode: each request's context after the step (MLA decode splits "
                         "past 64 tokens at batch 1, as a 512-token context does on a GPU)")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--set", action="append", default=[], metavar="module.NAME=value",
                    help="a module setting for the count (repeatable), as moe_bench.py "
                         "--variants takes them, e.g. engine.models.moe.ROUTER_ROUTE_FUSED=True")
    ap.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = ap.parse_args()
    from moe_variants import settings  # bench/ is the script's path

    with tempfile.TemporaryDirectory() as d, settings(",".join(args.set)):
        config = write_config(os.path.join(d, "config.json"), args.version)
        counts = (count_prefill_step(config, args.prefill) if args.prefill
                  else count_decode_step(config, batch=args.batch, context=args.context,
                                         block_size=args.block_size))
    if args.json:
        print(json.dumps(summary(counts), indent=1))
        return
    for where, c in counts.items():
        print(f"{where}: {c.total} kernels")
        for name, n in sorted(c.triton.items()):
            print(f"    triton {name} x{n}")
        for name, n in sorted(c.aten.items()):
            print(f"    aten   {name} x{n}")


if __name__ == "__main__":
    main()
