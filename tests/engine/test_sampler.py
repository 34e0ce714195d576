"""Sampler transforms on hand-made logits."""

from __future__ import annotations

import torch

from engine.sampler import SamplingBatch, apply_penalties, sample


def _batch(n: int, **kw) -> SamplingBatch:
    base = dict(temperature=torch.ones(n), top_k=torch.zeros(n, dtype=torch.int64),
                top_p=torch.ones(n), min_p=torch.zeros(n),
                seeds=torch.arange(n, dtype=torch.int64),
                positions=torch.zeros(n, dtype=torch.int64),
                all_greedy=False, any_top_k=False, any_top_p=False, any_min_p=False)
    base.update(kw)
    return SamplingBatch(**base)


LOGITS = torch.tensor([[0.0, 1.0, 2.0, 3.0, 2.5]])  # best: 3, then 4, then 2


def _draws(b: SamplingBatch, n: int = 400) -> set[int]:
    logits = LOGITS.repeat(n, 1)
    b.seeds = torch.arange(n, dtype=torch.int64)
    for name in ("temperature", "top_p", "min_p", "top_k"):
        setattr(b, name, getattr(b, name).repeat(n))
    b.positions = torch.zeros(n, dtype=torch.int64)
    return set(sample(logits, b).token_ids.tolist())


def test_greedy_and_temperature_zero_rows():
    b = _batch(1, temperature=torch.zeros(1), all_greedy=True)
    assert sample(LOGITS, b).token_ids.tolist() == [3]
    mixed = _batch(2, temperature=torch.tensor([0.0, 1.0]))
    assert sample(LOGITS.repeat(2, 1), mixed).token_ids[0].item() == 3


def test_top_k_top_p_min_p_restrict_the_support():
    assert _draws(_batch(1)) == {0, 1, 2, 3, 4}
    assert _draws(_batch(1, top_k=torch.tensor([2]), any_top_k=True)) == {3, 4}
    assert _draws(_batch(1, top_k=torch.tensor([1]), any_top_k=True)) == {3}
    # probs ~ [.03, .07, .19, .44, .27]: mass above token 4 is .44 (< .5) so it is kept
    assert _draws(_batch(1, top_p=torch.tensor([0.5]), any_top_p=True)) == {3, 4}
    assert _draws(_batch(1, top_p=torch.tensor([0.01]), any_top_p=True)) == {3}
    # min_p 0.5: keep tokens with p >= 0.5 * p_max -> tokens 3 (1.0) and 4 (e^-0.5 = 0.61)
    assert _draws(_batch(1, min_p=torch.tensor([0.5]), any_min_p=True)) == {3, 4}


def test_penalties():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    counts = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    b = _batch(1, repetition=torch.tensor([2.0]), frequency=torch.tensor([0.5]),
               presence=torch.tensor([0.25]), output_counts=counts,
               seen_mask=torch.tensor([[True, True, False, True]]))
    out = apply_penalties(logits.clone(), b)
    # token 0: 2/2 - 0.5*2 - 0.25 = -0.25; token 1: -1*2 - 0.5 - 0.25 = -2.75;
    # token 2: untouched; token 3 (prompt only): 1/2
    assert torch.allclose(out, torch.tensor([[-0.25, -2.75, 0.5, 0.5]]))


def test_banned_tokens_and_logprobs():
    b = _batch(1, temperature=torch.zeros(1), all_greedy=True,
               banned=torch.tensor([[False, False, False, True, False]]), max_logprobs=2)
    out = sample(LOGITS, b)
    assert out.token_ids.tolist() == [4]  # 3 is banned (e.g. EOS under min_tokens)
    ref = torch.log_softmax(LOGITS, -1)
    assert torch.allclose(out.logprobs, ref[:, 4])
    assert out.top_ids.tolist() == [[3, 4]]  # alternatives from the unmodified distribution
    assert torch.allclose(out.top_logprobs, ref[:, [3, 4]])


def test_top_k_alone_selects_without_a_full_sort_and_matches_the_sort_path():
    from engine.sampler import SamplingBatch, _filter

    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(4, 1000, generator=gen) * 3, dim=-1)  # no ties
    top_k = torch.tensor([5, 0, 1, 40])

    def batch(max_top_k: int) -> SamplingBatch:
        z = torch.zeros(4)
        return SamplingBatch(temperature=z + 1, top_k=top_k, top_p=z + 1, min_p=z,
                             seeds=top_k, positions=top_k, all_greedy=False, any_top_k=True,
                             any_top_p=False, any_min_p=False, max_top_k=max_top_k)

    fast, slow = _filter(probs, batch(40)), _filter(probs, batch(0))  # 0: the sort path
    torch.testing.assert_close(fast, slow)
    assert [(r > 0).sum().item() for r in fast] == [5, 1000, 1, 40]


def test_simple_sampler_hook_equals_the_full_sampler_and_is_skipped_when_not_simple():
    from kernels.ref_sample import sample_simple_ref

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3)) * 3
    b = _batch(4, temperature=torch.tensor([0.0, 1.0, 0.5, 2.0]),
               positions=torch.tensor([5, 6, 7, 8]))
    calls = []

    def hook(*a):
        calls.append(1)
        return sample_simple_ref(*a)

    assert torch.equal(sample(logits, b, simple=hook).token_ids, sample(logits, b).token_ids)
    assert calls == [1]
    b.any_top_p, b.top_p = True, torch.full((4,), 0.5)
    sample(logits, b, simple=hook)
    assert calls == [1]  # top-p needs the full sampler


def _req(prompt: list[int], outs: list[int]):
    from engine.request import Request
    from engine.sampling_params import SamplingParams

    return Request("r", prompt, SamplingParams(frequency_penalty=0.5), seed=1,
                   output_token_ids=list(outs))


def test_penalty_state_updates_from_sampled_ids_and_rebuilds_only_when_needed():
    from engine.penalty_state import PenaltyState
    from engine.request import PLACEHOLDER

    st = PenaltyState(10, torch.device("cpu"))
    a = _req([1, 2], [3, PLACEHOLDER])
    b = _req([9], [])
    counts, seen = st.tensors([a, b], torch.tensor([5, 4]), {id(a): 1})
    assert counts[0].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 0, 0] and counts[1].sum() == 0
    assert seen[0].nonzero().flatten().tolist() == [1, 2, 3, 4]
    assert seen[1].nonzero().flatten().tolist() == [9]
    assert st.num_rebuilds == 2
    # next step: the host read the 4; the new pending token is row 0 of the last step's ids
    a.output_token_ids[-1] = 4
    a.output_token_ids.append(PLACEHOLDER)
    b.output_token_ids.append(PLACEHOLDER)
    counts, seen = st.tensors([b, a], torch.tensor([4, 3]), {id(a): 1, id(b): 0})
    assert counts[1].tolist() == [0, 0, 0, 2, 1, 0, 0, 0, 0, 0]  # 3, 4, then 3 again
    assert counts[0].tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    assert st.num_rebuilds == 2  # both rows came from the device state
    # a new object (same id string, same lists) is rebuilt, never mixed with the old state
    a2 = _req([1, 2], [3, 4, 3])
    counts, _ = st.tensors([a2], None, {})
    assert counts[0].tolist() == [0, 0, 0, 2, 1, 0, 0, 0, 0, 0] and st.num_rebuilds == 3


def test_engine_penalties_from_device_state_equal_rebuilding_every_step(make_llm, tiny_models):
    from engine.sampling_params import SamplingParams

    prompts = [[5, 6, 7, 5, 6], [8, 8, 9], [1]]
    params = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0,
                             repetition_penalty=1.4, frequency_penalty=0.6,
                             presence_penalty=0.3, min_tokens=4),
              SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=3,
                             frequency_penalty=1.0),
              SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)]
    kept = make_llm(tiny_models["llama"], max_num_seqs=4, max_model_len=64)
    out_kept = kept.generate(prompts, params)
    assert kept.engine.runner.penalties.num_rebuilds == 3  # once per request of the batch
    fresh = make_llm(tiny_models["llama"], max_num_seqs=4, max_model_len=64)
    state = fresh.engine.runner.penalties
    orig = state.tensors

    def rebuild_every_step(*a):
        state._rows.clear()
        return orig(*a)

    state.tensors = rebuild_every_step
    out_fresh = fresh.generate(prompts, params)
    assert state.num_rebuilds >= 18
    assert [o.token_ids for o in out_kept] == [o.token_ids for o in out_fresh]


def test_min_tokens_ban_is_made_on_the_device_for_rows_under_it(make_llm, tiny_models):
    from engine.request import Request
    from engine.sampling_params import SamplingParams

    llm = make_llm(tiny_models["llama"], max_num_seqs=4, max_model_len=64)
    runner = llm.engine.runner
    under = Request("a", [1], SamplingParams(min_tokens=3, stop_token_ids=[7]), seed=1,
                    output_token_ids=[4])
    done = Request("b", [1], SamplingParams(min_tokens=1, stop_token_ids=[8]), seed=1,
                   output_token_ids=[4])
    b = runner._sampling_batch([under, done], None, {})
    assert b.banned is not None and b.banned.shape == (2, runner.vocab)
    assert b.banned[0].nonzero().flatten().tolist() == sorted({*runner.eos, 7})
    assert not b.banned[1].any()
    assert runner._sampling_batch([done], None, {}).banned is None


def test_a_structured_output_mask_keeps_the_simple_sampler_and_its_draws() -> None:
    from kernels.ref_sample import sample_simple_ref

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 70, generator=g) * 3
    b = _batch(4, temperature=torch.tensor([0.0, 1.0, 0.5, 2.0]),
               positions=torch.tensor([5, 6, 7, 8]))
    allowed = torch.zeros(4, 70, dtype=torch.bool)
    allowed[:, 60:66] = True  # words 1 and 2, bits past the first word
    words = torch.zeros(4, 3, dtype=torch.int64)
    for t in range(70):
        words[:, t // 32] |= allowed[:, t].long() << (t % 32)
    b.allowed = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    calls = []

    def hook(*a, **kw):
        calls.append(1)
        return sample_simple_ref(*a, **kw)

    fast = sample(logits, b, simple=hook).token_ids
    assert calls == [1] and ((fast >= 60) & (fast < 66)).all()
    assert torch.equal(fast, sample(logits, b).token_ids)  # the full sampler's draws


def test_a_draw_of_one_never_picks_a_token_of_probability_zero() -> None:
    """u = 1 happens (float32 rounds the largest noise value up), making E = 0: a masked or
    filtered token's score would be 0 / 0 = NaN, and argmax picks NaN."""
    from kernels.random_draw import race

    probs = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.0, 0.8]])
    expo = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 1.0]])
    assert race(probs, expo).argmax(dim=-1).tolist() == [1, 2]
