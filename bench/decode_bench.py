"""GPU decode benchmark: the engine's decode step against what its parts need.

In one run on one GPU, for a Llama-3-8B-shaped model (bf16, dummy weights):
  * HBM read rate (the fastest of bench/hbm_reader.py's readers over a 4 GiB tensor);
  * reference step = the model's linear layers as bare matmuls in one CUDA graph
    + the decode attention kernel alone (all layers, one CUDA graph) at the same batch
    and context;
  * the engine's decode step: requests admitted with their prompt KV already in place
    (``add_prefilled``, as a P/D consumer does), then timed ``LLMEngine.step()`` calls,
    each a full decode step (deferred output, one host read per step): the median of
    --repeats windows of --steps steps;
  * HF transformers' ``generate`` with ``cache_implementation="static"`` (batch 1, 8, 32;
    it compiles the decode step), per token from N vs 2N new tokens.

    python bench/decode_bench.py --out bench/results/decode_h200.json

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

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": False, "bos_token_id": 128000,
    "eos_token_id": 128001, "torch_dtype": "bfloat16", "model_type": "llama",
}


def capture(fn) -> torch.cuda.CUDAGraph:
    """``fn`` run once on a side stream (warm-up: compiles, allocates), then captured."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_time_ms(fn, iters: int = 20) -> float:
    """Median ms of one replay of ``fn`` captured in a CUDA graph."""
    g = capture(fn)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del g
    return sorted(times)[len(times) // 2]


def hbm_read_tbps() -> float:
    """The fastest read of a 4 GiB tensor among bench/hbm_reader.py's readers (torch's sum
    and a Triton streaming sum's sweep), in TB/s; each reader's rate is printed."""
    from bench.hbm_reader import read_rates

    x = torch.ones(2 << 30, dtype=torch.bfloat16, device="cuda")  # 4 GiB
    rates = read_rates(graph_time_ms, x)
    del x
    print("HBM read TB/s by reader", {k: round(v, 3) for k, v in rates.items()}, flush=True)
    return max(rates.values())


def matmul_ms(model, batch: int) -> float:
    x = torch.randn(batch, model.cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
    inter = torch.randn(batch, model.cfg.intermediate_size, dtype=torch.bfloat16, device="cuda")
    attn = torch.randn(batch, model.cfg.num_heads * model.cfg.head_dim, dtype=torch.bfloat16,
                       device="cuda")

    def step() -> None:
        for layer in model.layers:
            torch.nn.functional.linear(x, layer.self_attn.qkv_proj.weight)
            torch.nn.functional.linear(attn, layer.self_attn.o_proj.weight)
            torch.nn.functional.linear(x, layer.mlp.gate_up_proj.weight)
            torch.nn.functional.linear(inter, layer.mlp.down_proj.weight)
        torch.nn.functional.linear(x, model.lm_head.weight)

    return graph_time_ms(step)


def attention_ms(engine, tables: torch.Tensor, lens: torch.Tensor) -> float:
    from kernels.triton_decode_attention import decode_attention

    cfg = engine.model_cfg
    q = torch.randn(lens.shape[0], cfg.num_heads, cfg.head_dim, dtype=torch.bfloat16,
                    device="cuda")
    out = torch.empty_like(q)
    layers = [engine.kv_cache[:, i] for i in range(cfg.num_layers)]
    scale = cfg.head_dim ** -0.5

    def step() -> None:
        for kv in layers:
            decode_attention(q, kv, tables, lens, scale, out=out)

    return graph_time_ms(step)


def recapture(engine) -> None:
    """Captures the engine's decode graphs again (probes change kernel settings between)."""
    g = engine.runner.graphs
    g.graphs.clear()
    g.heads.clear()
    g.capture()


def engine_point(engine, batch: int, context: int, steps: int, repeats: int = 1) -> dict:
    """The decode step's wall time: the median over `repeats` windows of `steps` steps
    (the spread between windows is what a difference between versions must exceed)."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps * repeats + 8, ignore_eos=True)
    ids = []
    for i in range(batch):
        blocks = engine.reserve(context)
        if blocks is None:
            for rid in ids:
                engine.abort(rid)
            return {"batch": batch, "context": context, "skipped": "KV pool too small"}
        rid = f"b{batch}-c{context}-{i}"
        engine.add_prefilled(rid, [1 + (i + j) % 1000 for j in range(context)], params,
                             blocks, first_token=2)
        ids.append(rid)
    for _ in range(3):  # warm-up: the first steps also fill the deferred pipeline
        engine.step()
    windows = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        windows.append((time.perf_counter() - t0) / steps * 1e3)
    step_ms = sorted(windows)[len(windows) // 2]
    tables = torch.tensor([engine.requests[r].block_ids[: -(-context // engine.config.block_size)]
                           for r in ids], dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    # the GQA kernel alone; an MLA model's latent cache has its own (bench/moe_bench.py)
    att = None if engine.model_cfg.is_mla else attention_ms(engine, tables, lens)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    point = {"batch": batch, "context": context, "engine_step_ms": round(step_ms, 3),
             "engine_tok_s": round(batch / step_ms * 1e3, 1)}
    if att is not None:
        point["attention_ms"] = round(att, 3)
    if repeats > 1:
        point["engine_step_ms_windows"] = [round(w, 3) for w in windows]
    return point


def hf_generate_ms(cfg_dir: str, batch: int, context: int, steps: int) -> float:
    """Per-token ms of transformers' own ``generate`` with ``cache_implementation="static"``
    (which compiles the decode forward): the fastest way a user runs it. Timed as
    (time of 2N new tokens - time of N) / N, so the prefill and generate's set-up cancel;
    each length is run twice first (compiles, CUDA graphs)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(cfg_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 1000, (batch, context), device="cuda")
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, cache_implementation="static", pad_token_id=0)
        torch.cuda.synchronize()
        if out.shape[1] != context + n:
            raise RuntimeError(f"generate made {out.shape[1] - context} tokens, not {n}")
        return time.perf_counter() - t0

    with torch.inference_mode():
        for n in (steps, 2 * steps):
            run(n)
            run(n)
        short = sorted(run(steps) for _ in range(3))[1]
        long = sorted(run(2 * steps) for _ in range(3))[1]
    return (long - short) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,128,256")
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--hf-batches", default="1,8,32")
    ap.add_argument("--hf-steps", type=int, default=64,
                    help="N of the N vs 2N new tokens the transformers reference times")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed windows of --steps steps per point; the median is reported")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", default="bench/results/decode_h200.json")
    args = ap.parse_args()
    from engine.config import EngineConfig
    from engine.llm import build_engine

    batches = [int(b) for b in args.batches.split(",") if b]
    contexts = [int(c) for c in args.contexts.split(",") if c]
    cfg_dir = tempfile.mkdtemp()
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump(LLAMA3_8B, f)
    result: dict = {"device": torch.cuda.get_device_name(), "model": "Llama-3-8B shape, dummy",
                    "dtype": "bfloat16", "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    result["hbm_read_tb_s"] = round(hbm_read_tbps(), 3)
    print("HBM read TB/s", result["hbm_read_tb_s"], flush=True)
    t0 = time.perf_counter()
    engine = build_engine(EngineConfig(
        model=cfg_dir, dtype="bfloat16", device="cuda", load_format="dummy",
        max_num_seqs=max(batches),
        max_model_len=max(contexts) + args.steps * args.repeats + 64,
        max_num_batched_tokens=2048, gpu_memory_utilization=0.85,
        enforce_eager=args.enforce_eager))
    result["engine_build_s"] = round(time.perf_counter() - t0, 1)
    result["kv_blocks"] = engine.layout.num_blocks
    points = []
    mm = {b: matmul_ms(engine.runner.model, b) for b in batches}
    for ctx in contexts:
        for b in batches:
            try:
                p = engine_point(engine, b, ctx, args.steps, args.repeats)
            except Exception as e:  # keep the other points; the error is the result
                p = {"batch": b, "context": ctx, "error": repr(e)[:300]}
            if "skipped" not in p:
                p["matmul_ms"] = round(mm[b], 3)
                p["reference_step_ms"] = round(mm[b] + p["attention_ms"], 3)
                p["ratio_to_reference"] = round(p["engine_step_ms"] / p["reference_step_ms"], 3)
            print(json.dumps(p), flush=True)
            points.append(p)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    for b in [int(x) for x in args.hf_batches.split(",") if x]:
        try:
            ms = hf_generate_ms(cfg_dir, b, 512, args.hf_steps)
            gc.collect()
            torch.cuda.empty_cache()
        except Exception as e:
            result.setdefault("hf_errors", []).append(repr(e)[:300])
            print("hf", b, repr(e)[:300], flush=True)
            continue
        for p in points:
            if p["batch"] == b and p["context"] == 512:
                p["hf_generate_static_step_ms"] = round(ms, 3)
                if "engine_step_ms" in p:
                    p["speedup_vs_hf"] = round(ms / p["engine_step_ms"], 2)
        print("hf", b, round(ms, 3), flush=True)
    result["points"] = points
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
