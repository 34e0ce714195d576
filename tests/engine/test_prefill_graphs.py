"""Short single-request prefill steps through persistent buffers (engine/prefill_graphs.py):
buckets, eligibility and staging on CPU; the padded forward through the buffers equals the
eager engine on CPU (torch references) and, replayed as CUDA graphs, on the GPU."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
from tiny_models import make_tiny_model

from deploy.engine_args import add_engine_args, engine_config
from engine.config import EngineConfig
from engine.input_staging import PrefillStaging
from engine.prefill_graphs import input_words, prefill_inputs, token_buckets
from engine.request import PLACEHOLDER, Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BS = 16
# logprobs of every sampled token: the logits of the graph's last row, compared
LOGPROBS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)


def test_token_buckets():
    assert token_buckets(256) == [16, 32, 64, 128, 256]
    assert token_buckets(200) == [16, 32, 64, 128, 200]
    assert token_buckets(16) == [16]
    assert token_buckets(10) == [10]
    assert token_buckets(17) == [16, 17]


@pytest.mark.parametrize("w", [5, 6])  # the int32 part ends mid-word, or on a word
def test_input_views_partition_one_buffer(w):
    n = 4
    ints = torch.zeros(input_words(n, w), dtype=torch.int64)
    v = prefill_inputs(ints, n, w)
    assert v.block_table.shape == (1, w) and v.block_table.stride(1) == 1
    assert v.block_table.dtype == v.seq_lens.dtype == v.cu_seqlens_q.dtype == torch.int32
    v.input_ids.fill_(1)
    v.positions.fill_(2)
    v.slot_mapping.fill_(3)
    v.last.fill_(4)
    v.block_table.fill_(5)
    v.seq_lens.fill_(6)
    v.cu_seqlens_q.fill_(7)
    # every view kept its own value: none overlaps another
    assert v.input_ids.tolist() == [1] * n and v.positions.tolist() == [2] * n
    assert v.slot_mapping.tolist() == [3] * n and v.last.tolist() == [4]
    assert v.block_table.tolist() == [[5] * w] and v.seq_lens.tolist() == [6]
    assert v.cu_seqlens_q.tolist() == [7, 7]


def _req(prompt: list[int], blocks: list[int], outputs: list[int] = ()) -> Request:
    r = Request("r", list(prompt), SamplingParams(), seed=0)
    r.block_ids = list(blocks)
    r.output_token_ids = list(outputs)
    return r


def test_staging_writes_the_chunk_padded_to_its_bucket():
    prompt = list(range(100, 140))  # 40 tokens in blocks 7, 3, 9 (block size 16)
    r = _req(prompt, [7, 3, 9])
    st = PrefillStaging(max_tokens=32, max_blocks=4, block_size=BS, device=torch.device("cpu"))
    st.stage(r, start=20, n=13, bucket=16)  # positions 20..32: blocks 3 and 9
    dev = prefill_inputs(torch.zeros(input_words(32, 4), dtype=torch.int64), 32, 4)
    st.upload(dev.ints)
    assert dev.input_ids[:16].tolist() == prompt[20:33] + [0] * 3
    assert dev.positions[:16].tolist() == list(range(20, 33)) + [0] * 3
    want_slots = [(3 if p < 32 else 9) * BS + p % BS for p in range(20, 33)]
    assert dev.slot_mapping[:16].tolist() == want_slots + [-1] * 3
    assert dev.last.tolist() == [12]
    assert dev.block_table[0, :3].tolist() == [7, 3, 9]
    assert dev.seq_lens.tolist() == [33] and dev.cu_seqlens_q.tolist() == [0, 13]
    # the next step uses the other host buffer; a shorter chunk re-pads its rows
    st.stage(_req(prompt[:5], [1]), start=0, n=5, bucket=16)
    st.upload(dev.ints)
    assert dev.input_ids[:16].tolist() == prompt[:5] + [0] * 11
    assert dev.slot_mapping[:16].tolist() == [BS + p for p in range(5)] + [-1] * 11
    assert dev.last.tolist() == [4] and dev.cu_seqlens_q.tolist() == [0, 5]


def test_staging_reads_a_resumed_requests_output_tokens():
    # a preempted request recomputes past its prompt: the chunk spans prompt and outputs
    r = _req([1, 2, 3, 4], [2], outputs=[50, 51, 52])
    st = PrefillStaging(max_tokens=16, max_blocks=2, block_size=BS, device=torch.device("cpu"))
    st.stage(r, start=2, n=5, bucket=16)
    dev = prefill_inputs(torch.zeros(input_words(16, 2), dtype=torch.int64), 16, 2)
    st.upload(dev.ints)
    assert dev.input_ids[:5].tolist() == [3, 4, 50, 51, 52]
    assert dev.seq_lens.tolist() == [7]


def _buffered(llm, max_tokens: int) -> None:
    """The engine's runner takes eligible prefill steps through the padded buffers, run
    eagerly: what a CUDA graph replays, on the CPU."""
    runner = llm.engine.runner
    assert runner.prefill_graphs is None  # the CPU engine captures none itself
    runner.enable_prefill_graphs(max_tokens, runner.graphs.max_blocks, use_graphs=False)


def test_bucket_for_takes_one_short_known_chunk(make_llm, tiny_models):
    llm = make_llm(tiny_models["llama"], max_model_len=128, block_size=BS)
    _buffered(llm, 32)
    pg = llm.engine.runner.prefill_graphs
    assert pg.max_blocks == 8
    r = _req(list(range(60)), [0, 1, 2, 3])
    assert pg.bucket_for([ScheduledChunk(r, 40, 20, True)]) == 32
    assert pg.bucket_for([ScheduledChunk(r, 0, 16, False)]) == 16
    assert pg.bucket_for([ScheduledChunk(r, 0, 1, True)]) == 16
    assert pg.bucket_for([ScheduledChunk(r, 0, 33, False)]) is None  # past the largest
    two = [ScheduledChunk(r, 0, 8, False), ScheduledChunk(_req([1] * 8, [4]), 0, 8, True)]
    assert pg.bucket_for(two) is None  # several requests
    long = _req(list(range(60)), list(range(9)))
    assert pg.bucket_for([ScheduledChunk(long, 40, 20, True)]) is None  # table overflow
    # a chunk over outputs: fine once read, not while one is the previous step's sample
    resumed = _req([1, 2, 3], [5], outputs=[7, 8])
    assert pg.bucket_for([ScheduledChunk(resumed, 0, 5, True)]) == 16
    pending = _req([1, 2, 3], [5], outputs=[7, PLACEHOLDER])
    assert pg.bucket_for([ScheduledChunk(pending, 0, 5, True)]) is None
    assert pg.bucket_for([ScheduledChunk(pending, 0, 4, True)]) == 16  # stops before it


def _one_by_one(llm, prompts, params=LOGPROBS):
    """Each prompt alone (one request a step), in order, so that later prompts can hit
    the prefixes earlier ones left in the cache."""
    return [llm.generate([p], params)[0] for p in prompts]


def _same(got, want, atol):
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        la = torch.tensor([x.logprob for x in a.logprobs])
        lb = torch.tensor([x.logprob for x in b.logprobs])
        torch.testing.assert_close(la, lb, atol=atol, rtol=atol)


PREFIX = [(7 * i + 3) % 250 for i in range(48)]  # 3 full blocks
# cold prompts, a prefix hit with questions of 5 (bucket 16), 16 (exact) and 21 (32)
# tokens, and prompts longer than the step budget (chunks starting mid-block)
CPU_PROMPTS = [PREFIX + [1, 2, 3], [9, 9, 9, 1, 4], PREFIX + [4, 5, 6, 7, 8],
               PREFIX + list(range(20, 36)), PREFIX[:32] + list(range(40, 61)),
               list(range(10, 80))]


def test_cpu_buffered_prefill_equals_eager(make_llm, tiny_models):
    kw = dict(block_size=BS, max_model_len=256, max_num_batched_tokens=24)
    buffered = make_llm(tiny_models["llama"], **kw)
    _buffered(buffered, 32)
    pg = buffered.engine.runner.prefill_graphs
    got = _one_by_one(buffered, CPU_PROMPTS)
    assert pg.num_replays >= len(CPU_PROMPTS)
    eager = make_llm(tiny_models["llama"], **kw)
    _same(got, _one_by_one(eager, CPU_PROMPTS), atol=1e-4)
    assert eager.engine.prefix_cache_stats().hit_tokens > 0  # the prefix hits were tested


def test_cpu_steps_the_buffers_cannot_take_run_eagerly(make_llm, tiny_models):
    llm = make_llm(tiny_models["llama"], block_size=BS, max_model_len=256,
                   max_num_batched_tokens=128)
    _buffered(llm, 32)
    pg = llm.engine.runner.prefill_graphs
    llm.generate([list(range(10, 50))], LOGPROBS)  # one 40-token chunk: past 32
    assert pg.num_replays == 0
    llm.generate([[5, 6, 7], [8, 9, 10, 11]], LOGPROBS)  # two requests in one step
    assert pg.num_replays == 0
    llm.generate([list(range(10, 30))], LOGPROBS)  # 20 tokens alone: bucket 32
    assert pg.num_replays == 1


def _changed_slots(before: torch.Tensor, after: torch.Tensor) -> int:
    """(block, offset) token slots of any layer whose K or V changed."""
    diff = (before != after).flatten(start_dim=4).any(-1)  # [NB, L, 2, BS]
    return int(diff.any(1).any(1).sum())


def _writes_only_its_tokens(llm) -> None:
    eng = llm.engine
    pg = eng.runner.prefill_graphs
    base = pg.num_replays
    prompt = PREFIX[:37]  # one 37-token chunk, padded to a 64-row bucket
    before = eng.kv_cache.clone()
    llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    assert pg.num_replays == base + 1
    assert _changed_slots(before, eng.kv_cache) == len(prompt)


def test_cpu_padding_rows_write_no_kv(make_llm, tiny_models):
    llm = make_llm(tiny_models["llama"], block_size=BS, max_model_len=256)
    _buffered(llm, 64)
    _writes_only_its_tokens(llm)


def test_cpu_engine_captures_no_prefill_graphs(make_llm, tiny_models):
    assert make_llm(tiny_models["llama"]).engine.runner.prefill_graphs is None


def test_the_flag_reaches_the_config():
    assert EngineConfig().prefill_graph_max_tokens == 256
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args([])).prefill_graph_max_tokens == 256
    args = p.parse_args(["--prefill-graph-max-tokens", "64"])
    assert engine_config(args).prefill_graph_max_tokens == 64
    with pytest.raises(ValueError, match="prefill_graph_max_tokens"):
        EngineConfig(prefill_graph_max_tokens=-1)


# --- GPU: CUDA graphs --------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama with room for a 2,048-token prefix."""
    root = tmp_path_factory.mktemp("long")
    return make_tiny_model(os.path.join(root, "llama"), "llama", seed=3,
                           max_position_embeddings=4096)


GPU = dict(device="cuda", dtype="float32", block_size=BS, max_model_len=4096,
           max_num_batched_tokens=512, max_num_seqs=8)


def _prompts(gen: torch.Generator, prefix: list[int], questions: list[int]) -> list[list[int]]:
    return [prefix + torch.randint(3, 250, (q,), generator=gen).tolist() for q in questions]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("prefix_len", [0, 48, 37, 1100, 2048])
def test_graphs_equal_eager_prefill_on_gpu(make_llm, long_llama, prefix_len):
    """Questions of 3 to 200 tokens (buckets 16 .. 256, padded and not) alone, and after a
    prefix that the first prompt computes (its last chunk after 512-token ones when long)
    and leaves cached for the others (its full blocks)."""
    gen = torch.Generator().manual_seed(prefix_len)
    prefix = torch.randint(3, 250, (prefix_len,), generator=gen).tolist()
    prompts = _prompts(gen, prefix, [3, 5, 16, 37, 100, 128, 200])
    graphed = make_llm(long_llama, **GPU)
    pg = graphed.engine.runner.prefill_graphs
    assert pg is not None and pg.use_graphs and sorted(pg.graphs) == [16, 32, 64, 128, 256]
    base = pg.num_replays  # the start-up warm-up's steps (engine/warmup.py) may replay
    got = _one_by_one(graphed, prompts)
    # every prompt's last (or only) chunk is at most 256 tokens after a computed prefix
    assert pg.num_replays - base >= len(prompts)
    eager = make_llm(long_llama, prefill_graph_max_tokens=0, **GPU)
    assert eager.engine.runner.prefill_graphs is None
    _same(got, _one_by_one(eager, prompts), atol=1e-3)
    if prefix_len >= BS:
        assert graphed.engine.prefix_cache_stats().hit_tokens >= prefix_len // BS * BS


@pytest.mark.gpu
@needs_cuda
def test_graphs_equal_eager_prefill_with_sampling_options_on_gpu(make_llm, long_llama):
    """The sampler runs eagerly on the graph's last row: seeded top-p, penalties and
    min_tokens give the eager engine's tokens."""
    gen = torch.Generator().manual_seed(1)
    prompts = _prompts(gen, [], [20, 90, 130])
    params = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.8, seed=5, min_tokens=3,
                            repetition_penalty=1.3, logprobs=1)
    graphed = make_llm(long_llama, **GPU)
    pg = graphed.engine.runner.prefill_graphs
    base = pg.num_replays
    got = _one_by_one(graphed, prompts, params)
    assert pg.num_replays - base == len(prompts)
    eager = make_llm(long_llama, prefill_graph_max_tokens=0, **GPU)
    _same(got, _one_by_one(eager, prompts, params), atol=1e-3)


@pytest.mark.gpu
@needs_cuda
def test_fp8_kv_prefill_graphs_equal_eager_on_gpu(make_llm, long_llama):
    # a float8 cache: the layer's K and V scales are constants inside the graph
    gen = torch.Generator().manual_seed(4)
    prompts = _prompts(gen, torch.randint(3, 250, (200,), generator=gen).tolist(),
                       [9, 64, 130])
    kw = {**GPU, "kv_cache_dtype": "fp8"}
    graphed = make_llm(long_llama, **kw)
    pg = graphed.engine.runner.prefill_graphs
    base = pg.num_replays
    got = _one_by_one(graphed, prompts)
    assert pg.num_replays - base == len(prompts)
    _same(got, _one_by_one(make_llm(long_llama, prefill_graph_max_tokens=0, **kw), prompts),
          atol=1e-3)


@pytest.mark.gpu
@needs_cuda
def test_only_eligible_steps_replay_on_gpu(make_llm, long_llama):
    llm = make_llm(long_llama, **GPU)
    pg = llm.engine.runner.prefill_graphs
    base = pg.num_replays
    llm.generate([[3 + i % 240 for i in range(300)]], LOGPROBS)  # one chunk: past 256
    assert pg.num_replays == base
    llm.generate([[5, 6, 7] * 10, [8, 9, 10, 11] * 9], LOGPROBS)  # two requests a step
    assert pg.num_replays == base
    llm.generate([list(range(3, 103))], LOGPROBS)  # 100 tokens alone
    assert pg.num_replays == base + 1
    # a 1,000-token prompt: chunks 512 (eager) and 488 (eager); then its 1,024-token
    # extension hits 62 blocks and runs its last 32 tokens as a graph
    long = torch.randint(3, 250, (1000,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.generate([long], LOGPROBS)
    assert pg.num_replays == base + 1
    llm.generate([long + list(range(3, 27))], LOGPROBS)
    assert pg.num_replays == base + 2


@pytest.mark.gpu
@needs_cuda
def test_prefill_graphs_share_the_decode_pool_on_gpu(make_llm, long_llama):
    llm = make_llm(long_llama, **GPU)
    runner = llm.engine.runner
    pg, dg = runner.prefill_graphs, runner.graphs
    assert dg is not None and dg.use_graphs
    pool = next(iter(dg.graphs.values())).pool()
    assert all(g.pool() == pool for g in pg.graphs.values())
    assert pg.capture_s > 0
    # the tiny model's 256-token activations and split partials: a few MiB at most
    assert 0 <= pg.pool_bytes < 64 << 20


@pytest.mark.gpu
@needs_cuda
def test_graph_padding_rows_write_no_kv_on_gpu(make_llm, long_llama):
    _writes_only_its_tokens(make_llm(long_llama, **GPU))


@pytest.mark.gpu
@needs_cuda
def test_no_prefill_graphs_where_decode_has_none_or_when_off_on_gpu(make_llm, long_llama):
    assert make_llm(long_llama, enforce_eager=True, **GPU).engine.runner.prefill_graphs is None
    off = make_llm(long_llama, prefill_graph_max_tokens=0, **GPU)
    assert off.engine.runner.prefill_graphs is None
    # the step budget bounds the largest bucket
    small = make_llm(long_llama, **{**GPU, "max_num_batched_tokens": 100})
    assert sorted(small.engine.runner.prefill_graphs.graphs) == [16, 32, 64, 100]


@pytest.mark.gpu
@needs_cuda
def test_moe_prefill_graphs_equal_eager_on_gpu(make_llm, tmp_path):
    # the fused MoE kernel at each bucket's row count, padding rows routed like any other
    path = make_tiny_model(str(tmp_path / "moe"), "qwen3_moe", seed=2)
    kw = {**GPU, "max_model_len": 512}
    gen = torch.Generator().manual_seed(2)
    prompts = _prompts(gen, list(range(3, 51)), [7, 40, 150])
    graphed = make_llm(path, **kw)
    pg = graphed.engine.runner.prefill_graphs
    base = pg.num_replays
    got = _one_by_one(graphed, prompts)
    assert pg.num_replays - base >= len(prompts)
    _same(got, _one_by_one(make_llm(path, prefill_graph_max_tokens=0, **kw), prompts),
          atol=1e-3)


@pytest.mark.gpu
@needs_cuda
def test_mla_builds_no_prefill_graphs_on_gpu(make_llm, tmp_path):
    from tiny_deepseek import MODELS, make_tiny_deepseek

    version, kw = MODELS["v2"]
    path = make_tiny_deepseek(str(tmp_path / "v2"), version, **kw)
    llm = make_llm(path, device="cuda", dtype="float32", block_size=BS)
    assert llm.engine.runner.graphs.use_graphs and llm.engine.runner.prefill_graphs is None
