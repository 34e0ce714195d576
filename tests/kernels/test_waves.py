"""Split counts by waves (kernels/waves.py) and the decode launchers that use them."""

from __future__ import annotations

import pytest
import torch

from kernels.waves import wave_splits


def test_one_wave_beats_a_wave_and_a_straggler():
    # 264 slots: 128 pairs at 2 splits is one wave (256 programs); 3 splits would be 384,
    # a second wave of 120 programs as long as the first
    assert wave_splits(128, 264, 16, 4096) == 2
    assert wave_splits(32, 264, 16, 4096) == 8  # 256 programs, not 9 x 32 = 288


def test_whole_waves_past_one():
    # 512 pairs on 792 slots: 3 splits are 1,536 programs, two full waves; 2 splits (1,024)
    # also take two waves, with longer programs
    assert wave_splits(512, 792, 16, 4096) == 3
    # 1,024 pairs: 3 splits fill four waves 97%; 2 splits fill three 86%
    assert wave_splits(1024, 792, 16, 4096) == 3


def test_bounds_and_ties():
    assert wave_splits(8, 792, 32, 4096) == 32  # few pairs: every split fits one wave
    assert wave_splits(256, 792, 2, 512) == 2  # capped by `most`
    assert wave_splits(300, 264, 0, 4096) == 1
    # equal waves per split (1 wave either way): the fewer splits win the tie, and the fixed
    # cost of a program decides nearby ones
    assert wave_splits(100, 264, 2, 4096, fixed_tokens=0) == 2
    assert wave_splits(1, 1, 4, 4096, fixed_tokens=0) == 1
    with pytest.raises(ValueError, match="pairs"):
        wave_splits(0, 264, 4, 4096)


def test_fp8_decode_attention_splits_fill_waves(monkeypatch):
    # a float8 cache's grid on 132 SMs of ~6 programs: batch 32 (256 pairs of 8 KV heads)
    # at 3 splits is one wave; the programs-per-SM rule gave 5 (1,280 programs, 1.6 waves)
    import kernels.triton_decode_attention as tda
    monkeypatch.setattr(tda, "_num_sms", lambda device: 132)
    monkeypatch.setattr(tda, "FP8_RESIDENT_PER_SM", 6)
    dev = torch.device("cuda")
    assert tda.fp8_num_splits(32, 8, 4096, dev) == 3
    assert tda.fp8_num_splits(64, 8, 4096, dev) == 3
    assert tda.fp8_num_splits(1, 8, 4096, dev) == tda.FEW_PAIRS_MAX_SPLITS
    assert tda.fp8_num_splits(32, 8, 512, dev) == 2  # 256-token splits at the least
    assert tda.choose_num_splits(32, 8, 4096, dev, tda.FP8_PROGRAMS_PER_SM) == 5
