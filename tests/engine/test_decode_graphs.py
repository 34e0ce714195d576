"""Decode steps through persistent buffers: CUDA graphs on GPU equal the eager engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import EngineConfig
from engine.decode_graphs import batch_ladder
from engine.sampling_params import SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_batch_ladder_covers_every_batch_up_to_the_max():
    assert batch_ladder(1) == [1]
    assert batch_ladder(16) == [1, 2, 4, 8, 16]
    assert batch_ladder(20) == [1, 2, 4, 8, 16, 20]
    lad = batch_ladder(256)
    assert lad[:4] == [1, 2, 4, 8] and lad[-1] == 256
    assert all(b - a <= 8 for a, b in zip(lad, lad[1:], strict=False))


def test_cpu_decode_steps_use_the_staged_buffers_unpadded(make_llm, tiny_models):
    llm = make_llm(tiny_models["llama"], max_num_seqs=8, max_model_len=128)
    g = llm.engine.runner.graphs
    assert g is not None and not g.use_graphs and g.size_for(3) == 3
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6, 6, 6]
    assert g.num_head_replays >= 5  # temperature 1: every decode step sampled by the head
    ref = make_llm(tiny_models["llama"], max_num_seqs=8, max_model_len=128)
    ref.engine.runner.graphs = None  # the per-token eager path: same tokens
    refs = ref.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in refs]


def test_device_and_dtype_auto_resolve_to_the_cpu_without_a_gpu():
    if torch.cuda.is_available():
        cfg = EngineConfig(device="auto", dtype="auto")
        assert cfg.device == "cuda" and cfg.dtype == "bfloat16"
    else:
        cfg = EngineConfig(device="auto", dtype="auto")
        assert cfg.device == "cpu" and cfg.dtype == "float32"


@pytest.mark.parametrize("kw,field", [
    (dict(device="cpu", gpu_memory_utilization=0.5), "gpu_memory_utilization"),
    (dict(device="cuda", gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(device="tpu"), "device"),
])
def test_bad_sizing_flags_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kw)


def _run(llm, prompts, max_tokens):
    return llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                logprobs=2))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch", [1, 3, 5, 11])
def test_graphs_equal_eager_on_gpu(make_llm, tiny_models, batch):
    """Batches 3, 5 and 11 replay graphs of 4, 8 and 16 rows: padding changes nothing."""
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 200, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 40, (batch,), generator=gen)]
    kw = dict(device="cuda", dtype="float32", max_num_seqs=16, max_model_len=256)
    graphed = make_llm(tiny_models["llama"], **kw)
    g = graphed.engine.runner.graphs
    assert g is not None and g.use_graphs and sorted(g.graphs) == [1, 2, 4, 8, 16]
    eager = make_llm(tiny_models["llama"], enforce_eager=True, **kw)
    assert not eager.engine.runner.graphs.use_graphs
    out_g = _run(graphed, prompts, 10)
    assert g.num_replays >= 9  # every step after the prefill replayed a graph
    out_e = _run(eager, prompts, 10)
    for a, b in zip(out_g, out_e, strict=True):
        assert a.token_ids == b.token_ids
        la = torch.tensor([x.logprob for x in a.logprobs])
        lb = torch.tensor([x.logprob for x in b.logprobs])
        torch.testing.assert_close(la, lb, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@needs_cuda
def test_graph_pool_fits_its_budget_and_utilization_sizes_the_pool(make_llm, tiny_models):
    from engine.memory_budget import graph_bytes, kv_bytes_for_utilization

    # The fraction counts every process's memory (other tests may hold some): ask for
    # what is in use now plus 2% of the device.
    free, total = torch.cuda.mem_get_info()
    util = min(1.0, (total - free) / total + 0.02)
    llm = make_llm(tiny_models["llama"], device="cuda", dtype="bfloat16", max_num_seqs=64,
                   gpu_memory_utilization=util)
    eng = llm.engine
    elem = 2
    assert eng.runner.graphs.pool_bytes <= graph_bytes(eng.config, eng.model_cfg, elem) + (64 << 20)
    kv = kv_bytes_for_utilization(eng.config, eng.model_cfg, eng.device)
    assert 0 < kv < 0.02 * total
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_bytes_for_utilization(dataclasses.replace(eng.config, gpu_memory_utilization=0.001),
                                 eng.model_cfg, eng.device)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


@pytest.mark.gpu
@needs_cuda
def test_reading_a_step_does_not_wait_for_work_queued_after_it():
    """The host reads step N while step N+1 still runs: a second of GPU work queued after
    the sampled ids must not delay reading them (a plain .tolist() would wait for it)."""
    import time

    from engine.sampler import SamplerOutput

    ids = torch.arange(5, device="cuda") * 7
    out = SamplerOutput(ids)
    out.start_host_copy()
    torch.cuda.synchronize()
    out2 = SamplerOutput(ids + 1)
    out2.start_host_copy()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning at H200 clocks, queued after out2
    t0 = time.perf_counter()
    got = out2.token_ids.tolist()
    waited = time.perf_counter() - t0
    assert got == [1, 8, 15, 22, 29]
    assert out.token_ids.tolist() == [0, 7, 14, 21, 28]
    assert waited < 0.3, f"read waited {waited:.3f}s: it waited for later work"
    assert torch.equal(out2.device_token_ids, ids + 1)  # the device copy stays for inputs
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch", [1, 6])
def test_graph_head_samples_like_eager_on_gpu(make_llm, tiny_models, batch):
    """Greedy and temperature-only rows are sampled inside the head graph; the eager engine
    samples the same rows with the same kernel outside any graph: same tokens."""
    prompts = [[(7 * i + j) % 300 + 1 for j in range(5 + 3 * i)] for i in range(batch)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=t, seed=11 + i)
              for i, t in enumerate([0.0, 0.8, 1.0, 0.0, 1.5, 0.6][:batch])]
    kw = dict(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=256)
    graphed = make_llm(tiny_models["llama"], **kw)
    g = graphed.engine.runner.graphs
    out_g = graphed.generate(prompts, params)
    assert g.num_replays >= 11 and g.num_head_replays == g.num_replays
    eager = make_llm(tiny_models["llama"], enforce_eager=True, **kw)
    out_e = eager.generate(prompts, params)
    assert [o.token_ids for o in out_g] == [o.token_ids for o in out_e]
    assert all(len(o.token_ids) == 12 for o in out_g)
