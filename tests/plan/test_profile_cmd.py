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
    assert rc == 0, capsys.readouterr().err
    p = Profile.load(str(out))
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
