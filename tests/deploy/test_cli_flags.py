"""The CLI's promises about flags: engine flags are the same on every command that runs an
engine (`launch` passes them to its workers), --help shows defaults (never a secret's), and
the embedded model answers to its HF id too."""

from __future__ import annotations

import pytest

from deploy.cli import build_parser
from deploy.launch_cmd import spec_from_args
from engine.model_source import EMBEDDED_HF_ID, resolve_model


def _launch(*argv: str) -> tuple[str, ...]:
    args = build_parser().parse_args(["launch", "--grpc-port", "0", "--http-port", "0", *argv])
    return spec_from_args(args).worker_args


def test_launch_passes_engine_flags_to_every_worker() -> None:
    worker_args = _launch("--kv-cache-mib", "64", "--max-num-seqs", "8", "--enforce-eager",
                          "--block-size", "32")
    assert set(worker_args) == {"--kv-cache-mib=64", "--max-num-seqs=8", "--enforce-eager",
                                "--block-size=32"}
    # ... as flags a worker's own command line takes
    args = build_parser().parse_args(["producer", "--router", "x:1", *worker_args])
    assert (args.kv_cache_mib, args.max_num_seqs, args.enforce_eager, args.block_size) == (
        64, 8, True, 32)


def test_launch_turns_an_on_by_default_flag_off_on_its_workers_too() -> None:
    # it went to the workers as --enable-prefix-caching: the cache stayed on
    worker_args = _launch("--no-enable-prefix-caching")
    assert worker_args == ("--no-enable-prefix-caching",)
    args = build_parser().parse_args(["consumer", "--router", "x:1", *worker_args])
    assert args.enable_prefix_caching is False


def test_launch_passes_only_the_engine_flags_given() -> None:
    assert _launch() == ()
    # --worker-arg (and a --config's engine:) first: the command line's flags win
    assert _launch("--worker-arg=--kv-cache-mib=32", "--kv-cache-mib", "64") == (
        "--kv-cache-mib=32", "--kv-cache-mib=64")


@pytest.mark.parametrize("command", [["launch"], ["generate"], ["producer"], ["consumer"],
                                     ["colocated"], ["router"], ["bench"], ["plan", "profile"]])
def test_help_shows_defaults_but_no_secret(command: list[str], capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_API_KEY", "sekrit-key")
    monkeypatch.setenv("PDSERVE_CLUSTER_TOKEN", "sekrit-token")
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    assert "sekrit" not in out
    if command[0] in ("launch", "generate", "producer", "consumer", "colocated") \
            or command == ["plan", "profile"]:
        assert "KV pool size in MiB (default: 512)" in out
        assert "--max-num-seqs MAX_NUM_SEQS default: 64" in out


def test_the_embedded_model_answers_to_its_hf_id() -> None:
    assert resolve_model(EMBEDDED_HF_ID) == resolve_model("smollm2") == resolve_model(None)
    args = build_parser().parse_args(["launch", "--grpc-port", "0", "--http-port", "0",
                                      "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"])
    spec_from_args(args)  # the launcher's model check accepts it


def test_a_workers_default_id_names_no_role() -> None:
    """The router may change a worker's role and the id stays: so no role in a default id."""
    from deploy.worker_cmd import worker_id

    parser = build_parser()
    ids = {worker_id(parser.parse_args([role, "--router", "x:1"]))
           for role in ("producer", "consumer", "colocated")}
    assert len(ids) == 3 and all(i.startswith("worker-") for i in ids), ids
    assert worker_id(parser.parse_args(["producer", "--router", "x:1", "--worker-id",
                                        "pod-7"])) == "pod-7"


def test_kv_cache_dtype_reaches_every_worker_and_its_engine() -> None:
    from deploy.engine_args import engine_config

    worker_args = _launch("--kv-cache-dtype", "fp8")
    assert worker_args == ("--kv-cache-dtype=fp8",)
    for role in ("producer", "consumer", "colocated"):
        args = build_parser().parse_args([role, "--router", "x:1", *worker_args])
        cfg = engine_config(args)
        assert (cfg.kv_cache_dtype, cfg.kv_dtype) == ("fp8", "float8_e4m3fn")
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--kv-cache-dtype", "fp8"])
    assert engine_config(args).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):  # argparse names the flag and its choices
        build_parser().parse_args(["consumer", "--router", "x:1", "--kv-cache-dtype", "int8"])
