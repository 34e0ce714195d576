"""The KV fingerprint's model identity comes from the weights, not the directory's name."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tiny_models import make_tiny_model

from engine.model_identity import HEAD_BYTES, SAMPLE_BYTES, SAMPLES, model_identity
from engine.model_source import embedded_model_path


def test_same_weights_anywhere_match_and_other_weights_of_the_same_name_do_not(
        tmp_path: Path) -> None:
    a = make_tiny_model(str(tmp_path / "a" / "llama-tiny"), "llama", seed=0)
    copy = str(tmp_path / "elsewhere" / "llama-tiny")
    shutil.copytree(a, copy)
    other = make_tiny_model(str(tmp_path / "b" / "llama-tiny"), "llama", seed=1)
    ida = model_identity(a)
    assert ida.startswith("llama-tiny@") and ida == model_identity(copy)
    assert model_identity(other) != ida  # same name and shape, other weights


def test_dummy_weights_never_match_real_ones_and_depend_on_the_seed(tmp_path: Path) -> None:
    d = make_tiny_model(str(tmp_path / "m"), "qwen2")
    real, dummy = model_identity(d), model_identity(d, "dummy", seed=0)
    assert dummy.startswith("dummy-m@") and dummy != real
    assert model_identity(d, "dummy", seed=0) == dummy != model_identity(d, "dummy", seed=1)
    assert model_identity(os.path.join(d, "config.json"), "dummy") == dummy


def test_config_bytes_count_too(tmp_path: Path) -> None:
    d = make_tiny_model(str(tmp_path / "m"), "llama")
    before = model_identity(d)
    cfg = Path(d, "config.json")
    cfg.write_text(cfg.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    assert model_identity(d) != before


def test_large_files_are_sampled_and_a_change_in_a_sample_is_seen(tmp_path: Path) -> None:
    d = tmp_path / "big"
    d.mkdir()
    (d / "config.json").write_text("{}")
    blob = bytearray(os.urandom(HEAD_BYTES + SAMPLES * SAMPLE_BYTES * 4))
    (d / "model.safetensors").write_bytes(bytes(blob))
    before = model_identity(str(d))
    stride = (len(blob) - HEAD_BYTES) // SAMPLES
    blob[HEAD_BYTES + 7 * stride + 5] ^= 0xFF  # inside the 8th sample
    (d / "model.safetensors").write_bytes(bytes(blob))
    assert model_identity(str(d)) != before


def test_the_embedded_gguf_has_a_stable_identity_and_engines_advertise_it(make_llm) -> None:  # type: ignore[no-untyped-def]
    ident = model_identity(embedded_model_path())
    assert ident.startswith("smollm2@") and ident == model_identity(embedded_model_path())
    llm = make_llm(None, kv_cache_bytes=4 << 20)
    assert llm.engine.layout.model == ident
