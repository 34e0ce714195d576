"""MoE decode benchmark: a MoE model's decode step, and the fused MoE kernel alone (and,
for an MLA model, the MLA decode kernel alone), each against the HBM byte floor measured
in the same run.

Shapes (--shape; bf16, dummy weights): ``qwen3`` Qwen3-30B-A3B (48 layers, hidden 2048,
32/4 heads of 128, 128 experts top-8, moe_intermediate 768, vocab 151936); ``v2lite``
DeepSeek-V2-Lite (27 layers, hidden 2048, 16 MLA heads, kv_lora 512 + rope 64, a dense
first layer, 64 routed experts top-6 + 2 shared, moe_intermediate 1408, vocab 102400);
``mixtral`` Mixtral-8x7B (32 layers, hidden 4096, 32/8 heads of 128, 8 experts top-2,
intermediate 14336, vocab 32000: 93 GB of bf16 weights, so ``--layers`` fewer on an 80 GB
card; its top-2 routing gives the fewest (token, expert) pairs a token of the three).
``--layers N`` sets any shape's layer count (a shape that does not fit, or a quicker A/B).
In one run on one GPU:
  * HBM read rate (the fastest of bench/hbm_reader.py's readers over a 4 GiB tensor) and
    the bf16 matmul rate (8192^3 GEMM);
  * per (batch, context): the engine's decode step (CUDA graphs, deferred output; the
    median of --repeats windows of --steps steps), the distinct experts each layer's
    routing touched in one step (one eager step with hooks on the MoE blocks), and the
    step's floor = (dense weights + the touched experts + the KV read) / HBM read rate;
  * per batch: the fused MoE kernel alone over all 48 layers' experts (one CUDA graph,
    routing drawn uniformly), its bytes (the distinct experts it reads) over its time
    against the HBM read rate;
  * prefill of one --prefill-tokens prompt: its time and FLOP rate against the matmul rate;
  * MLA models: the paged MLA decode kernel alone over all layers at each (batch,
    context), its latent bytes over its time against the HBM read rate;
  * optionally transformers' own generate with cache_implementation="static" (compiled;
    --hf-batches), per token from N vs 2N new tokens.

``--quantization fp8`` quantizes the dummy weights at load (per-channel scales: dense
projections and routed experts; MLA attention, shared experts and the head stay bf16);
``fp8-block`` gives the dummy config a block-wise 128 x 128 ``quantization_config``
(DeepSeek-V3's format) instead. The fused kernel then reads FP8 experts, its bytes are the
FP8 bytes (scales included), and each kernel point also times one layer's experts both as
FP8 and as the same weights dequantized to bf16 (the same routings, in one run).

    python bench/moe_bench.py --out $OUT/moe_h200.json
    python bench/moe_bench.py --shape v2lite --hf-batches 1,8 --out $OUT/moe_v2lite_h200.json
    python bench/moe_bench.py --quantization fp8 --out $OUT/moe_fp8_h200.json
    python bench/moe_bench.py --shape v2lite --profile --batches 1,8 --contexts 512 \
        --out $OUT/moe_v2lite_profile.json   # per-kernel tables, decode and a 4k prefill
                                             # (bench/moe_profile.py)
    python bench/moe_bench.py --shape v2lite --batches 1,8 --variants \
        "kernels.pdl.ENABLED=False;kernels.triton_mla_decode.FEW_PROGRAMS_MIN_SPLIT_TOKENS=256" \
        --out $OUT/moe_v2lite_variants.json   # the decode step per setting, interleaved
    python bench/moe_bench.py --shape v2lite --batches "" --out $OUT/p.json  # prefill only
    python bench/moe_bench.py --tune   # tile candidates (bench/moe_tune.py) for moe_configs.json
    python bench/moe_bench.py --tune --quantization fp8   # FP8 experts' ("<device> fp8")

Points whose KV does not fit the device are recorded with ``"skipped"``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe_floor import (  # noqa: E402
    dense_weight_bytes,
    dense_weight_params,
    expert_bytes,
    expert_params,
    kv_values_per_token,
    moe_blocks,
    touched_experts,
)
from moe_shapes import SHAPES, shape_config  # noqa: E402

# N of the N vs 2N new tokens transformers' reference is timed over (decode_bench's
# --hf-steps default). At N = 20 two runs of the same call gave 8.45 and 5.05 ms a step at
# batch 1 (2026-12-04, bench/RESULTS.md): the difference of two short generate calls is
# mostly host noise.
HF_STEPS = 64


def matmul_tflops() -> float:
    from decode_bench import graph_time_ms

    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = graph_time_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def decode_point(engine: Any, batch: int, context: int, steps: int, repeats: int,
                 hbm: float) -> dict[str, Any]:
    from decode_bench import engine_point

    cfg = engine.model_cfg
    model = engine.runner.model
    point = engine_point(engine, batch, context, steps, repeats)
    if "skipped" in point:
        return point
    # routing seen on a fresh batch of the same shape (engine_point aborted its requests)
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ids = []
    for i in range(batch):
        blocks = engine.reserve(context)
        if blocks is None:
            break
        rid = f"route-{batch}-{context}-{i}"
        engine.add_prefilled(rid, [1 + (7 * i + j) % 1000 for j in range(context)], params,
                             blocks, first_token=2)
        ids.append(rid)
    engine.step()
    touched = touched_experts(engine)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    blocks = moe_blocks(model)
    eb = expert_bytes(blocks[0])
    kv = batch * context * cfg.num_layers * kv_values_per_token(cfg) * 2
    floor_bytes = dense_weight_bytes(model) + sum(touched) * eb + kv
    floor_ms = floor_bytes / (hbm * 1e12) * 1e3
    point.update({
        "experts_touched_mean": round(sum(touched) / len(touched), 1),
        "floor_bytes": floor_bytes, "floor_ms": round(floor_ms, 3),
        "ratio_to_floor": round(point["engine_step_ms"] / floor_ms, 3)})
    return point


def mla_kernel_point(model: Any, batch: int, context: int, hbm: float,
                     tiles: dict[str, int] | None = None) -> dict[str, Any]:
    """The paged MLA decode kernel alone over every layer (one graph): ``batch`` requests
    of ``context`` tokens each, each layer on its own latent cache, as a step reads them.

    Until session 49 every layer read one cache: where a layer's cache fits in L2 (V2-Lite
    at batch 8 x 512, 32 x 512, 1 x 4,096) layers 2-27 read it from L2, and the kernel's
    fraction of HBM read came out 9-20% high (bench/RESULTS.md). Where 27 caches do not fit
    in half the free memory, as many as do take turns; past two they are each far larger
    than L2. ``l2_resident`` marks a point whose caches all fit in L2 together (a graph's
    replays then read them from there, where a step's weights would have evicted them)."""
    from decode_bench import graph_time_ms

    from kernels.triton_mla_decode import mla_decode

    cfg = model.cfg
    c, r, heads = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_heads
    bs = 16
    per_req = -(-context // bs)
    nblocks = batch * per_req
    one = nblocks * bs * (c + r) * 2
    room = int(torch.cuda.mem_get_info()[0] * 0.5)
    if one * 2 > room:
        return {"batch": batch, "context": context, "skipped": "cache does not fit"}
    caches = [torch.randn(nblocks, 1, bs, 1, c + r, dtype=torch.bfloat16, device="cuda")
              for _ in range(min(cfg.num_layers, room // one))]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    q = torch.randn(batch, heads, c + r, dtype=torch.bfloat16, device="cuda")
    tables = torch.arange(nblocks, dtype=torch.int32, device="cuda").view(batch, per_req)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    out = q.new_empty(batch, heads, c)
    scale = (cfg.qk_nope_head_dim + r) ** -0.5

    def run() -> None:
        for layer in range(cfg.num_layers):
            mla_decode(q, caches[layer % len(caches)], tables, lens, scale, c, out,
                       max_seq_len=context, **(tiles or {}))

    ms = graph_time_ms(run)
    nbytes = cfg.num_layers * batch * context * (c + r) * 2
    tbps = nbytes / (ms * 1e-3) / 1e12
    return {"batch": batch, "context": context, "kernel_ms_all_layers": round(ms, 3),
            "kernel_tb_s": round(tbps, 3), "fraction_of_hbm_read": round(tbps / hbm, 3),
            "distinct_caches": len(caches), "l2_resident": len(caches) * one <= l2}


def kernel_point(model: Any, batch: int, hbm: float, config: dict[str, int] | None = None,
                 compare: bool = False) -> dict[str, Any]:
    """The fused MoE kernel alone over every layer's experts (one graph), uniform routing;
    compare: FP8 experts also timed against one layer dequantized to bf16."""
    from decode_bench import graph_time_ms

    from kernels.triton_moe import fused_moe

    blocks = moe_blocks(model)
    cfg = model.cfg.moe
    h = model.cfg.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(batch)
    x = torch.randn(batch, h, dtype=torch.bfloat16, device="cuda", generator=gen)
    ids = [torch.rand(batch, cfg.num_experts, device="cuda", generator=gen)
           .argsort(dim=1)[:, :cfg.top_k] for _ in blocks]  # distinct experts per token
    w = torch.softmax(torch.randn(batch, cfg.top_k, device="cuda", generator=gen), dim=-1)
    touched = sum(int(torch.unique(i).numel()) for i in ids)

    def run() -> None:
        for blk, i in zip(blocks, ids, strict=True):
            fused_moe(x, blk.experts.w13, blk.experts.w2, w, i, 0, config=config,
                      **scales(blk))

    ms = graph_time_ms(run)
    nbytes = touched * expert_bytes(blocks[0]) + len(blocks) * batch * h * 2 * 2
    tbps = nbytes / (ms * 1e-3) / 1e12
    # the routed experts' matmul work (gate/up and down), for prefill-sized calls
    inter = blocks[0].experts.w2.shape[-1]
    flops = len(blocks) * batch * cfg.top_k * 2 * 3 * h * inter
    point = {"batch": batch, "kernel_ms_all_layers": round(ms, 3),
             "experts_touched_mean": round(touched / len(blocks), 1),
             "kernel_tb_s": round(tbps, 3), "fraction_of_hbm_read": round(tbps / hbm, 3),
             "tflops": round(flops / (ms * 1e-3) / 1e12, 1)}
    if compare and blocks[0].experts.w13_scale is not None:
        point.update(fp8_vs_bf16_one_layer(blocks[0], x, w, ids, config))
    return point


def scales(block: Any) -> dict[str, Any]:
    """fused_moe's scale arguments for a block's experts (none for bf16 experts)."""
    e = block.experts
    if e.w13_scale is None:
        return {}
    return {"w13_scale": e.w13_scale, "w2_scale": e.w2_scale}


def fp8_vs_bf16_one_layer(block: Any, x: torch.Tensor, w: torch.Tensor,
                          ids: list[torch.Tensor], config: dict[str, int] | None
                          ) -> dict[str, Any]:
    """One layer's FP8 experts against the same weights dequantized to bf16: each run
    goes through every layer's routing (the same list both ways) on this one layer."""
    from decode_bench import graph_time_ms

    from kernels.ref_fp8 import dequant_stack
    from kernels.triton_moe import fused_moe

    e = block.experts
    w13 = dequant_stack(e.w13, e.w13_scale).to(torch.bfloat16)
    w2 = dequant_stack(e.w2, e.w2_scale).to(torch.bfloat16)

    def fp8() -> None:
        for i in ids:
            fused_moe(x, e.w13, e.w2, w, i, 0, config=config, **scales(block))

    def bf16() -> None:
        for i in ids:
            fused_moe(x, w13, w2, w, i, 0, config=config)

    fp8_ms, bf16_ms = graph_time_ms(fp8), graph_time_ms(bf16)
    return {"one_layer_fp8_ms": round(fp8_ms, 3), "one_layer_bf16_ms": round(bf16_ms, 3),
            "one_layer_fp8_over_bf16": round(fp8_ms / bf16_ms, 3)}


def prefill_point(engine: Any, tokens: int, mm_tflops: float) -> dict[str, Any]:
    from fresh_prefill import fresh_prompt, prefill_uncached

    times = []
    runner = engine.runner
    execute = runner.execute
    launched: list[float] = []

    def timed_execute(*a: Any, **kw: Any) -> Any:
        out = execute(*a, **kw)
        launched.append(time.perf_counter())
        return out

    graphs = runner.prefill_graphs
    replayed = graphs.num_replays if graphs is not None else 0  # the warm-up's, before these
    runner.execute = timed_execute  # when the host has launched the step's last kernel
    try:
        for _ in range(3):  # the first run compiles the prefill shapes
            # a prompt new to this process: a --prefill-variants round after the first
            # would otherwise find the last round's prompts in the prefix cache
            prompt = fresh_prompt(tokens)
            torch.cuda.synchronize()
            launched.clear()
            t0 = time.perf_counter()
            prefill_uncached(engine, f"prefill-{prompt[0]}", prompt)
            torch.cuda.synchronize()
            times.append(((time.perf_counter() - t0) * 1e3, (launched[-1] - t0) * 1e3))
    finally:
        runner.execute = execute
    ms, launch_ms = sorted(times[1:])[0]
    # steps of these three runs replayed as prefill graphs (0: all eager)
    replays = graphs.num_replays - replayed if graphs is not None else 0
    tflops = prefill_flops(engine, tokens) / (ms * 1e-3) / 1e12
    # host_launch_ms near prefill_ms: the step waits on the host's launches, not the GPU
    return {"tokens": tokens, "prefill_ms": round(ms, 2), "host_launch_ms": round(launch_ms, 2),
            "tflops": round(tflops, 1), "fraction_of_matmul_rate": round(tflops / mm_tflops, 3),
            "prefill_graph_replays": replays}


def prefill_flops(engine: Any, tokens: int) -> float:
    """The matmul FLOPs of one `tokens`-token prefill: a token's active weights (every
    non-expert matrix but the embedding and the head, plus per MoE layer its top-k routed
    experts and its shared experts), causal attention, and the head for one row.

    Shared experts are non-expert weights unless the block folded them into its stacked
    experts (bf16 on one rank: SparseMoeBlock.folded_shared), where they count as that many
    more experts every token runs. Until session 49 the folded ones were left out: V2-Lite's
    bf16 prefill rates were 1/1.217 of the true ones (bench/RESULTS.md)."""
    cfg = engine.model_cfg
    model = engine.runner.model
    moe = cfg.moe
    assert moe is not None
    blocks = moe_blocks(model)
    head = cfg.vocab_size * cfg.hidden_size
    per_token_experts = moe.top_k + blocks[0].folded_shared
    active = (dense_weight_params(model) - head
              + len(blocks) * per_token_experts * expert_params(blocks[0]))
    # causal QK^T and PV: T^2/2 query-key pairs, 2 FLOPs per multiply-add, per dim
    qk_pv = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim if cfg.is_mla
             else 2 * cfg.head_dim)
    return float(2 * tokens * active + cfg.num_layers * cfg.num_heads * qk_pv * tokens * tokens
                 + 2 * head)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3")
    ap.add_argument("--layers", type=int, default=None,
                    help="the shape's num_hidden_layers replaced (the label says so)")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill-tokens", type=int, default=4096,
                    help="the prefill point's prompt length (0: no prefill point)")
    ap.add_argument("--hf-batches", default="", help="e.g. 1,8: transformers' static-cache "
                    "decode at context 512 (loads a second copy of the model)")
    ap.add_argument("--tune", action="store_true", help="time tile candidates only")
    ap.add_argument("--tune-mla", action="store_true",
                    help="time MLA decode tile candidates only (an MLA --shape)")
    ap.add_argument("--quantization", choices=("fp8", "fp8-block"), default=None,
                    help="FP8 weights: per-channel at load, or a block-wise 128 x 128 "
                    "quantization_config")
    ap.add_argument("--profile", action="store_true",
                    help="only per-kernel tables: the decode step at each (batch, context), "
                    "CUDA time and launches per step, and one --prefill-tokens prefill's "
                    "(0: none) (torch.profiler)")
    ap.add_argument("--variants", default="",
                    help="';'-separated variants, each ','-joined module.NAME=value settings: "
                         "only the decode step under each, interleaved with the defaults over "
                         "--repeats rounds (bench/moe_variants.py)")
    ap.add_argument("--kernel-variants", default="",
                    help="';'-separated variants as --variants: only the fused MoE kernel "
                         "(and MLA decode kernel) alone under each, rounds alternating")
    ap.add_argument("--tune-tma", action="store_true",
                    help="time the tensor-memory form's tile candidates (kernels/"
                         "triton_moe_tma.py) at each --batches token count, against the "
                         "decode form's table tile in the same run")
    ap.add_argument("--prefill-variants", default="",
                    help="';'-separated variants as --variants: only the --prefill-tokens "
                         "prefill under each, interleaved with the defaults over --repeats "
                         "rounds")
    ap.add_argument("--prefill-graph-max-tokens", type=int, default=None,
                    help="the engine's prefill graphs up to this many tokens (default: the "
                    "engine's own); MLA models build none")
    ap.add_argument("--moe-table", default=None, metavar="NAME", help="the fused MoE "
                    "kernel's tiles of this kernels/moe_configs.json entry, not the GPU's "
                    "own (e.g. 'NVIDIA H200' on an H100: bench/moe_table.py)")
    ap.add_argument("--out", default="bench/results/moe_h200.json")
    args = ap.parse_args()
    if args.moe_table:  # before any launch; a name the table lacks raises, naming it
        import moe_table
        moe_table.use(args.moe_table)
    if args.quantization and args.tune_mla:
        ap.error("--tune-mla: MLA reads bf16 weights; leave out --quantization")
    from decode_bench import hbm_read_tbps, hf_generate_ms
    from moe_profile import prefill_kernels, profile_table
    from moe_tune import tune, tune_mla, tune_tma

    from engine.config import EngineConfig
    from engine.llm import build_engine

    batches = [int(b) for b in args.batches.split(",") if b]
    contexts = [int(c) for c in args.contexts.split(",") if c]
    cfg_dir = tempfile.mkdtemp()
    try:
        label, hf_config = shape_config(args.shape, args.layers, args.quantization)
    except ValueError as e:
        ap.error(str(e))
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump(hf_config, f)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "model": label,
        "dtype": "bfloat16", "quantization": args.quantization,
        "torch": torch.__version__, "command": " ".join(sys.argv),
        "moe_table": args.moe_table,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    hbm = hbm_read_tbps()
    result["hbm_read_tb_s"] = round(hbm, 3)
    mm = matmul_tflops()
    result["bf16_matmul_tflops"] = round(mm, 1)
    print("HBM read TB/s", result["hbm_read_tb_s"], "matmul TFLOP/s", result["bf16_matmul_tflops"],
          flush=True)
    t0 = time.perf_counter()
    engine = build_engine(EngineConfig(
        model=cfg_dir, dtype="bfloat16", device="cuda", load_format="dummy",
        max_num_seqs=max(batches, default=1),
        max_model_len=max(max(contexts, default=0) + args.steps * args.repeats + 64,
                          args.prefill_tokens + 8),
        max_num_batched_tokens=max(2048, args.prefill_tokens), gpu_memory_utilization=0.9,
        quantization="fp8" if args.quantization == "fp8" else None,
        **({} if args.prefill_graph_max_tokens is None
           else {"prefill_graph_max_tokens": args.prefill_graph_max_tokens})))
    result["engine_build_s"] = round(time.perf_counter() - t0, 1)
    result["kv_blocks"] = engine.layout.num_blocks
    pg = engine.runner.prefill_graphs
    result["prefill_graphs"] = None if pg is None else {
        "buckets": pg.buckets, "pool_mib": pg.pool_bytes >> 20,
        "capture_s": round(pg.capture_s, 1)}
    model = engine.runner.model
    result["dense_weight_bytes"] = dense_weight_bytes(model)
    result["expert_bytes"] = expert_bytes(moe_blocks(model)[0])
    from moe_variants import variant_sections
    if sections := variant_sections(args, engine, model, hbm, mm, batches, contexts):
        result.update(sections)  # --variants, --kernel-variants, --prefill-variants
    elif args.tune_tma:
        result["tuned_tma"] = tune_tma(model, hbm, batches)
        print(json.dumps(result["tuned_tma"], indent=1))
    elif args.profile:
        result["decode_profile"] = profile_table(engine, batches, contexts, args.steps)
        if args.prefill_tokens:
            result["prefill_profile"] = prefill_kernels(engine, args.prefill_tokens)
    elif args.tune_mla:
        result["tuned_mla"] = tune_mla(model, hbm, [(b, c) for c in contexts for b in batches])
        print(json.dumps(result["tuned_mla"], indent=1))
    elif args.tune:
        result["tuned"] = tune(model, hbm, batches)
        print(json.dumps(result["tuned"], indent=1))
    else:
        kernels = []
        for b in batches:
            try:
                p = kernel_point(model, b, hbm, compare=True)
            except Exception as e:  # keep the other points; the error is the result
                p = {"batch": b, "error": repr(e)[:300]}
            print(json.dumps(p), flush=True)
            kernels.append(p)
        result["fused_moe_kernel"] = kernels
        if model.cfg.is_mla:
            mla = []
            for ctx in contexts:
                for b in batches:
                    try:
                        p = mla_kernel_point(model, b, ctx, hbm)
                    except Exception as e:
                        p = {"batch": b, "context": ctx, "error": repr(e)[:300]}
                    print(json.dumps(p), flush=True)
                    mla.append(p)
            result["mla_decode_kernel"] = mla
        points = []
        for ctx in contexts:
            for b in batches:
                try:
                    p = decode_point(engine, b, ctx, args.steps, args.repeats, hbm)
                except Exception as e:
                    p = {"batch": b, "context": ctx, "error": repr(e)[:300]}
                print(json.dumps(p), flush=True)
                points.append(p)
        result["decode"] = points
        if args.prefill_tokens:  # 0: no prefill point
            try:
                result["prefill"] = prefill_point(engine, args.prefill_tokens, mm)
            except Exception as e:
                result["prefill"] = {"error": repr(e)[:300]}
            print(json.dumps(result["prefill"]), flush=True)
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()
    save(result, args.out)  # again after each generate: a timeout keeps what was measured
    for b in [int(x) for x in args.hf_batches.split(",") if x]:
        try:
            ms = hf_generate_ms(cfg_dir, b, 512, max(args.steps, HF_STEPS))
        except Exception as e:
            result.setdefault("hf_errors", []).append(repr(e)[:300])
            continue
        for p in result.get("decode", []):
            if p.get("batch") == b and p.get("context") == 512:
                p["hf_generate_static_step_ms"] = round(ms, 3)
                if "engine_step_ms" in p:
                    p["speedup_vs_hf"] = round(ms / p["engine_step_ms"], 2)
        result.setdefault("hf_generate_static_step_ms", {})[str(b)] = round(ms, 3)
        print("hf", b, round(ms, 3), flush=True)
        save(result, args.out)
    print(json.dumps(result, indent=1))


def save(result: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
