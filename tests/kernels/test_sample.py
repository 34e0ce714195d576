"""The simple sampler kernel against its torch reference (interpreter on CPU, GPU with -m gpu)."""

from __future__ import annotations

import pytest
import torch

from kernels.random_draw import uniform_noise
from kernels.ref_sample import sample_simple_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(s: int, v: int, gen: torch.Generator, device: torch.device, spread: float):
    logits = (torch.randn(s, v, generator=gen) * spread).to(device)
    temp = torch.tensor([0.0, 1.0, 0.7, 2.0, 0.0, 1.3][:s] * (s // 6 + 1), dtype=torch.float32)
    seeds = torch.randint(0, 2**62, (s,), generator=gen)
    pos = torch.randint(0, 100_000, (s,), generator=gen)
    return logits, temp[:s].to(device), seeds.to(device), pos.to(device)


def _kernel(*a):
    from kernels.triton_sample import sample_simple

    return sample_simple(*a)


@pytest.mark.parametrize("v", [1000, 20_000])  # one chunk; several chunks and a ragged tail
def test_flat_logits_pick_the_largest_noise(gen, device, v):
    # Equal logits: every hot row's draw is the argmax of its noise, so this checks the
    # kernel's uint32 hash bit for bit against the reference's int64 one.
    s = 6
    _, temp, seeds, pos = _inputs(s, v, gen, device, 1.0)
    logits = torch.zeros(s, v, device=device)
    got = _kernel(logits, temp, seeds, pos).cpu()
    noise = uniform_noise(seeds.cpu(), pos.cpu(), v)
    hot = temp.cpu() > 0
    assert torch.equal(got[hot], noise.argmax(dim=-1)[hot])
    assert (got[~hot] == 0).all()  # greedy ties: the first index, as torch.argmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_reference(gen, device, dtype):
    # Spread logits: ties in p / E are far apart, so the log-domain race equals the
    # reference's token for token.
    logits, temp, seeds, pos = _inputs(12, 9000, gen, device, 4.0)
    logits = logits.to(dtype)
    ref = sample_simple_ref(logits.cpu(), temp.cpu(), seeds.cpu(), pos.cpu())
    got = _kernel(logits, temp, seeds, pos)
    assert torch.equal(got.cpu(), ref)
    out = torch.full((12,), -1, dtype=torch.int64, device=device)
    assert _kernel(logits, temp, seeds, pos, out) is out and torch.equal(out.cpu(), ref)


def test_draws_follow_the_distribution(gen, device):
    # 600 positions of one row over 4 tokens: frequencies near softmax(x / T).
    v, n = 4, 600
    x = torch.tensor([1.0, 0.0, -1.0, 0.5])
    logits = x.repeat(n, 1).to(device)
    temp = torch.full((n,), 0.8, device=device)
    seeds = torch.full((n,), 7, dtype=torch.int64, device=device)
    pos = torch.arange(n, device=device)
    got = _kernel(logits, temp, seeds, pos).cpu()
    freq = torch.bincount(got, minlength=v).float() / n
    assert (freq - torch.softmax(x / 0.8, dim=0)).abs().max() < 0.08


def test_rejects_bad_inputs(device):
    logits = torch.zeros(2, 10, device=device)
    t = torch.ones(2, device=device)
    i = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="temperature"):
        _kernel(logits, t.double(), i, i)
    with pytest.raises(ValueError, match="seeds"):
        _kernel(logits, t, i[:1], i)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("s", [1, 128])
def test_gpu_llama3_vocab(gen, s):
    logits, temp, seeds, pos = _inputs(s, 128256, gen, torch.device("cuda"), 4.0)
    ref = sample_simple_ref(logits, temp, seeds, pos)
    assert torch.equal(_kernel(logits.bfloat16().float(), temp, seeds, pos),
                       sample_simple_ref(logits.bfloat16().float(), temp, seeds, pos))
    assert torch.equal(_kernel(logits, temp, seeds, pos), ref)
