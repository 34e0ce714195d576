"""``pdserve plan profile`` end to end: the real engine on a tiny model, real UCX transfer."""

from tiny_models import make_tiny_model

from deploy.cli import main
from deploy.plan.profile import Profile


def test_profile_command_measures_a_real_worker(tmp_path, capsys):
    model = make_tiny_model(str(tmp_path / "tiny"), "llama")
    out = tmp_path / "profile.json"
    rc = main(["plan", "profile", "--model", model, "--out", str(out), "--kv-cache-mib", "8",
               "--prefill-tokens", "8,32,64", "--decode-batch", "1,8",
               "--decode-context", "16,64", "--reps", "1",
               # 8 x 64 tokens take 8 steps to prefill: the first requests decode meanwhile
               "--max-num-batched-tokens", "64"])
    # A tiny model's steps are all fixed cost: on a loaded CI machine its curve can come
    # out flat-noisy, which the command must then report (and exit 1); the file is written
    # either way (the refusal itself: test_profile_command_refuses_to_pass_off_noise).
    err = capsys.readouterr().err
    p = Profile.load(str(out))
    assert rc == (1 if p.problems else 0), err
    assert bool(p.problems) == ("cannot be trusted" in err)
    assert p.prefill.tokens == (8, 32, 64) and len(p.prefill.ms) == 3
    assert p.decode.batch == (1, 8) and p.decode.context == (16, 64)
    assert all(v > 0 for row in p.decode.ms for v in row)
    # 2 layers x (K, V) x 2 KV heads x 16 dims x 4 bytes (float32)
    assert p.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    # 8 MiB of 8 KiB blocks, under the 64 seats x 32 blocks cap
    assert p.kv_capacity_tokens == 1024 * 16
    assert p.transfer_GBps > 0
    assert p.device == "cpu" and p.block_size == 16
    assert p.model == model  # what the launch line must repeat, not the KV digest


def test_profile_command_rejects_a_bad_grid(tmp_path, capsys):
    rc = main(["plan", "profile", "--out", str(tmp_path / "p.json"),
               "--prefill-tokens", "64,16"])
    assert rc == 2
    assert "--prefill-tokens" in capsys.readouterr().err


def test_profile_command_refuses_to_pass_off_noise(tmp_path, capsys, monkeypatch):
    """A busy machine: timings jump around and a bigger prompt looks cheaper. The profile
    samples more, measures such points again, then says so and exits 1; plan refuses it."""
    import itertools

    from deploy.plan import measure

    noise = itertools.cycle([5.0, 40.0, 1.0, 90.0, 3.0])
    monkeypatch.setattr(measure, "_timed_step", lambda engine: (engine.step(), next(noise))[1])
    model = make_tiny_model(str(tmp_path / "tiny"), "llama")
    out = tmp_path / "profile.json"
    rc = main(["plan", "profile", "--model", model, "--out", str(out), "--kv-cache-mib", "8",
               "--prefill-tokens", "8,32", "--decode-batch", "1", "--decode-context", "16",
               "--reps", "2", "--max-reps", "4", "--max-num-batched-tokens", "64"])
    err = capsys.readouterr().err
    assert rc == 1 and "cannot be trusted" in err and "noisy" in err
    p = Profile.load(str(out))
    assert p.problems and all(s > p.tolerance for s in p.prefill_spread)
    assert main(["plan", "--profile", str(out), "--gpus", "2", "--rate", "1",
                 "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100"]) == 2


def test_profile_command_measures_an_mla_moe_model(tmp_path, capsys):
    """DeepSeek-V2 (MLA + routed and shared experts): the profile's KV is the latent, one
    row of kv_lora_rank + qk_rope_head_dim values a token a layer, not K and V per head."""
    from tiny_deepseek import MODELS, make_tiny_deepseek

    version, kw = MODELS["v2"]
    model = make_tiny_deepseek(str(tmp_path / "ds"), version, **kw)
    out = tmp_path / "profile.json"
    rc = main(["plan", "profile", "--model", model, "--out", str(out), "--kv-cache-mib", "4",
               "--dtype", "float32", "--prefill-tokens", "8,32", "--decode-batch", "1,4",
               "--decode-context", "16", "--reps", "1", "--max-num-batched-tokens", "64"])
    p = Profile.load(str(out))
    assert rc == (1 if p.problems else 0), capsys.readouterr().err
    # 2 layers x (latent 32 + rope 16) x 4 bytes (float32)
    assert p.kv_bytes_per_token == 2 * (32 + 16) * 4
    assert p.kv_capacity_tokens == 4 * 2**20 // p.kv_bytes_per_token // 16 * 16
    assert p.prefill.tokens == (8, 32) and all(v > 0 for v in p.prefill.ms)
    assert p.decode.batch == (1, 4) and all(v > 0 for row in p.decode.ms for v in row)
