"""The simulated engine (--simulate-step-ms): the real scheduler and output path, no model.

Its steps take the configured time, its tokens are a pure function of (seed, position) and
never EOS unless asked, so a producer -> consumer handoff gives the colocated tokens and an
ignore-EOS-like run is exact."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest

from deploy.benchmark.dummy_model import write_dummy_model
from deploy.engine_args import add_engine_args, engine_config
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.sim_config import SimConfig
from engine.sim_runner import SimRunner


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A weightless model directory: the tiny Llama config and a word-level tokenizer."""
    return write_dummy_model(str(tmp_path_factory.mktemp("simmodel")), "tiny")


def sim_llm(model: str, step_ms: float = 0.0, **kw: object) -> LLM:
    sim = SimConfig(step_ms=step_ms, **{k: kw.pop(k) for k in (
        "prefill_us_per_token", "eos_prob", "prefill_launch_ms") if k in kw})
    return LLM(model, simulate=sim, **kw)


PROMPTS = [[5, 17, 33, 90, 12, 7, 8, 3, 100, 200, 44], [9, 9, 9, 1, 4], list(range(10, 60))]


def test_steps_take_the_configured_time_and_run_to_max_tokens(model_dir):
    llm = sim_llm(model_dir, step_ms=10)
    t0 = time.monotonic()
    (c,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=20))
    took = time.monotonic() - t0
    assert len(c.token_ids) == 20 and c.finish_reason == "length"
    assert took >= 0.19, took  # one 10 ms step per token (deferred output hides nothing)
    assert took < 2.0, took
    assert 2 not in c.token_ids  # the tiny config's EOS
    # real detokenization with the served tokenizer: one word per token
    assert c.text.split() == [f"t{t}" for t in c.token_ids]


def test_batch_shares_steps(model_dir):
    # 16 requests decode together: the batch takes about as many steps as one request
    llm = sim_llm(model_dir, step_ms=10, max_num_seqs=16)
    t0 = time.monotonic()
    outs = llm.generate([PROMPTS[i % 3] for i in range(16)], SamplingParams(max_tokens=20))
    took = time.monotonic() - t0
    assert [len(c.token_ids) for c in outs] == [20] * 16
    assert 0.19 <= took < 1.5, took


def test_prefill_time_per_token(model_dir):
    llm = sim_llm(model_dir, step_ms=1, prefill_us_per_token=4000, role="producer",
                  max_num_batched_tokens=512)
    eng = llm.engine
    eng.add_request("r", PROMPTS[2], SamplingParams(max_tokens=4))  # 50 prompt tokens
    t0 = time.monotonic()
    outs = []
    while not outs:
        outs = eng.step().outputs
    assert time.monotonic() - t0 >= 0.2  # 50 x 4 ms, on top of the 1 ms step
    assert len(outs[0].new_token_ids) == 1
    eng.release("r")


def test_tokens_are_a_function_of_seed_and_position(model_dir):
    p = SamplingParams(max_tokens=12, seed=7, temperature=0.8, top_k=5)
    alone = sim_llm(model_dir).generate([PROMPTS[1]], p)[0].token_ids
    batched = sim_llm(model_dir, max_num_seqs=4).generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[2]],
        [SamplingParams(max_tokens=9, seed=1), p, SamplingParams(max_tokens=30)])[1].token_ids
    direct = sim_llm(model_dir, defer_output=False).generate([PROMPTS[1]], p)[0].token_ids
    assert alone == batched == direct
    other_seed = sim_llm(model_dir).generate(
        [PROMPTS[1]], SamplingParams(max_tokens=12, seed=8))[0].token_ids
    assert other_seed != alone


@pytest.mark.parametrize("logprobs", [None, 2], ids=["plain", "logprobs"])
def test_producer_to_consumer_handoff_equals_colocated(model_dir, logprobs):
    params = SamplingParams(max_tokens=12, seed=11, logprobs=logprobs)
    prompt = PROMPTS[2]
    ref = sim_llm(model_dir, block_size=4).generate([prompt], params)[0]

    prod = sim_llm(model_dir, block_size=4, role="producer", max_num_batched_tokens=16).engine
    cons = sim_llm(model_dir, block_size=4, role="consumer").engine
    prod.add_request("r", prompt, params)
    outs = []
    while not outs:
        outs = prod.step().outputs
    (t0,) = outs
    dst = cons.reserve(len(prompt))
    assert dst is not None
    prod.release("r")
    cons.add_prefilled("r", prompt, params, dst, t0.new_token_ids[0],
                       t0.new_logprobs[0] if logprobs else None)
    tokens, lps = list(t0.new_token_ids), list(t0.new_logprobs)
    while cons.has_unfinished():
        for o in cons.step().outputs:
            tokens += o.new_token_ids
            lps += o.new_logprobs
    assert tokens == ref.token_ids and len(tokens) == 12
    assert lps == ref.logprobs
    if logprobs:
        assert all(r.top[0] == (r.token_id, r.logprob) and len(r.top) == 2 for r in lps)


def test_stops_are_honoured(model_dir):
    llm = sim_llm(model_dir)
    free = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10, seed=3))[0]
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    got = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10, seed=3,
                                                    stop_token_ids=[stop_at]))[0]
    assert got.token_ids == free.token_ids[:first + 1] and got.finish_reason == "stop"
    word = f"t{free.token_ids[3]}"
    cut = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10, seed=3, stop=[word]))[0]
    assert cut.finish_reason == "stop" and word not in cut.text
    assert cut.text == free.text[:free.text.index(word)]


def test_eos_only_when_asked(model_dir):
    llm = sim_llm(model_dir, eos_prob=1.0)
    (c,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10, min_tokens=3))
    assert c.finish_reason == "stop" and len(c.token_ids) == 4 and c.token_ids[-1] == 2
    (c,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10, ignore_eos=True))
    assert len(c.token_ids) == 10  # EOS sampled every step, ignored


def test_pool_is_tiny_and_never_pairs_with_the_real_model(model_dir):
    eng = sim_llm(model_dir, num_kv_blocks=64).engine
    assert isinstance(eng.runner, SimRunner)
    assert eng.layout.num_layers == 1 and eng.layout.num_kv_heads == 1
    assert eng.layout.model.startswith("sim:")
    assert eng.model_cfg.vocab_size == 32000
    assert eng.kv_cache.device.type == "cpu"


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(list(argv))


def test_flags():
    assert engine_config(_args()).simulate is None
    cfg = engine_config(_args("--simulate-step-ms", "12.5", "--simulate-prefill-us-per-token",
                              "3", "--simulate-eos-prob", "0.01",
                              "--simulate-prefill-launch-ms", "18"))
    assert cfg.simulate == SimConfig(step_ms=12.5, prefill_us_per_token=3, eos_prob=0.01,
                                     prefill_launch_ms=18)
    with pytest.raises(ValueError, match="^--simulate-eos-prob: needs --simulate-step-ms"):
        engine_config(_args("--simulate-eos-prob", "0.5"))
    with pytest.raises(ValueError, match="^--simulate-prefill-launch-ms: needs --simulate-s"):
        engine_config(_args("--simulate-prefill-launch-ms", "5"))
    for bad, flag in ((dict(step_ms=-1), "simulate_step_ms"),
                      (dict(step_ms=float("nan")), "simulate_step_ms"),
                      (dict(step_ms=1, prefill_us_per_token=-2), "simulate_prefill_us_per_token"),
                      (dict(step_ms=1, eos_prob=1.5), "simulate_eos_prob"),
                      (dict(step_ms=1, prefill_launch_ms=-1), "simulate_prefill_launch_ms")):
        with pytest.raises(ValueError, match=f"^{flag}:"):
            SimConfig(**bad)  # type: ignore[arg-type]


def test_tensor_parallel_is_refused(model_dir):
    with pytest.raises(ValueError, match="^simulate_step_ms: a simulated engine has one rank"):
        LLM(model_dir, simulate=SimConfig(step_ms=1), tensor_parallel_size=2)


def test_flags_and_config_load_no_torch():
    # the worker's gRPC process and the router parse these flags: no torch there
    code = ("import sys, deploy.engine_args, engine.sim_config, engine.config; "
            "assert 'torch' not in sys.modules, 'torch loaded'")
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy())


def test_every_command_passes_the_flag(model_dir):
    from deploy.bench_cmd import build_targets
    from deploy.cli import build_parser
    from deploy.launch_cmd import spec_from_args as launch_spec
    from deploy.worker_cmd import spec_from_args as worker_spec

    for role in ("producer", "consumer", "colocated"):
        args = build_parser().parse_args([role, "--router", "127.0.0.1:1", "--model", model_dir,
                                          "--simulate-step-ms", "7"])
        assert worker_spec(args, role).engine.simulate == SimConfig(step_ms=7)
    args = build_parser().parse_args(["launch", "--model", model_dir, "--grpc-port", "0",
                                      "--http-port", "0", "--worker-arg=--simulate-step-ms=7"])
    assert "--simulate-step-ms=7" in launch_spec(args).worker_args
    args = build_parser().parse_args(["bench", "--launch", "pd", "--model", model_dir,
                                      "--simulate-step-ms", "7",
                                      "--simulate-prefill-us-per-token", "2"])
    (target,) = build_targets(args)
    assert target.spec is not None
    assert target.spec.worker_args[-2:] == ("--simulate-step-ms=7.0",
                                            "--simulate-prefill-us-per-token=2.0")
    args = build_parser().parse_args(["bench", "--launch", "pd",
                                      "--simulate-prefill-us-per-token", "2"])
    with pytest.raises(ValueError, match="^--simulate-prefill-us-per-token: needs"):
        build_targets(args)


def test_a_producer_step_lets_the_caller_work_until_the_simulated_device_is_done(model_dir):
    """A producer reads each step at once; while the simulated step still "runs" the engine
    calls ``device_wait`` (the worker's loop takes commands then) instead of blocking."""
    eng = sim_llm(model_dir, step_ms=50, role="producer").engine
    assert not eng.defers_output
    looks: list[float] = []
    lefts: list[float] = []

    def look(left_s: float) -> None:
        looks.append(time.monotonic())
        lefts.append(left_s)
        time.sleep(0.001)

    eng.device_wait = look
    eng.add_request("r", PROMPTS[0], SamplingParams(max_tokens=4))
    t0 = time.monotonic()
    step = eng.step()
    took = time.monotonic() - t0
    assert [o.request_id for o in step.outputs] == ["r"]  # token 0, read once done
    assert took >= 0.05
    assert len(looks) >= 10 and looks[-1] - t0 >= 0.04  # called throughout the step
    # with the simulated device's own count of what is left, falling to the end
    assert 0.03 < lefts[0] <= 0.05 and lefts == sorted(lefts, reverse=True)


def test_a_prefill_launch_holds_the_host_and_calls_the_layer_hook(model_dir):
    """--simulate-prefill-launch-ms: a step with prompt tokens spends that long launching on
    the host, the between-layer hook called after each simulated layer (a producer's
    commands are taken there); decode steps launch at once; the step ends when both the
    launch and the device's time are done."""
    from engine.sim_runner import SIM_LAYERS

    eng = sim_llm(model_dir, step_ms=5, prefill_launch_ms=40, role="producer").engine
    layers: list[float] = []
    eng.between_launches = lambda: layers.append(time.monotonic())
    eng.add_request("r", PROMPTS[0], SamplingParams(max_tokens=4))
    t0 = time.monotonic()
    step = eng.step()
    took = time.monotonic() - t0
    assert [o.request_id for o in step.outputs] == ["r"]
    assert took >= 0.04  # the launch's 40 ms, beside which the 5 ms device time ran
    assert len(layers) == SIM_LAYERS
    gaps = [b - a for a, b in zip([t0, *layers], layers, strict=False)]
    assert max(gaps) < 0.02, gaps  # spread along the launch, not bunched at its end
    assert eng.runner.between_layers is None  # the hook is the producer step's alone
    eng.release("r")

    # a decoder launches at once: its steps take the device's time only
    dec = sim_llm(model_dir, step_ms=5, prefill_launch_ms=40).engine
    dec.add_request("d", PROMPTS[0], SamplingParams(max_tokens=12))
    t1 = time.monotonic()
    while dec.has_unfinished():
        dec.step()
    assert time.monotonic() - t1 < 0.04 + 12 * 0.005 + 0.25  # one prefill launch, not 12
