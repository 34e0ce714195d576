"""bench/moe_table.py: a bench on one card reads another card's fused-MoE tiles by name,
refuses a name the table lacks, and leaves the lookup as it was when unset."""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

CUDA = torch.device("cuda")  # only its type is read: no GPU is touched while NAME is set


@pytest.fixture(scope="module")
def mods():
    if not torch.cuda.is_available():  # read when @triton.jit kernels are defined
        os.environ.setdefault("TRITON_INTERPRET", "1")
    triton_moe = importlib.import_module("kernels.triton_moe")
    moe_table = importlib.import_module("moe_table")
    with open(triton_moe.CONFIG_FILE) as f:
        table = json.load(f)["configs"]
    return triton_moe, moe_table, table


def test_a_named_table_gives_that_cards_tiles(mods, monkeypatch):
    triton_moe, moe_table, table = mods
    monkeypatch.setattr(moe_table, "NAME", "NVIDIA H200")
    # batch 1 reads the smallest bucket: the H200's 128-column tiles, not the default's 64
    assert triton_moe.tile_config(1, CUDA) == table["NVIDIA H200"]["8"]
    assert triton_moe.tile_config(1, CUDA)["BLOCK_N"] != table["default"]["8"]["BLOCK_N"]
    assert triton_moe.tile_config(100, CUDA) == table["NVIDIA H200"]["256"]
    # FP8 experts read the card's "fp8" entry
    assert triton_moe.tile_config(1, CUDA, 1) == table["NVIDIA H200 fp8"]["8"]
    monkeypatch.setattr(moe_table, "NAME", "default")
    assert triton_moe.tile_config(100, CUDA) == table["default"]["256"]


def test_an_unknown_name_is_refused_naming_the_entries(mods, monkeypatch):
    triton_moe, moe_table, _ = mods
    monkeypatch.setattr(moe_table, "NAME", "NVIDIA H20")
    with pytest.raises(ValueError, match=r"moe_table.NAME: 'NVIDIA H20' is not in .*"
                                         r"NVIDIA H200"):
        triton_moe.tile_config(1, CUDA)


def test_unset_or_on_cpu_the_lookup_is_the_devices_own(mods, monkeypatch):
    triton_moe, moe_table, table = mods
    assert moe_table.NAME is None
    assert triton_moe.tile_config(1, torch.device("cpu")) == table["cpu"]["8"]
    monkeypatch.setattr(moe_table, "NAME", "NVIDIA H200")
    # the interpreter keeps its own entry whatever the bench names
    assert triton_moe.tile_config(1, torch.device("cpu")) == table["cpu"]["8"]


def test_the_bench_variant_syntax_sets_and_restores_it(mods):
    triton_moe, moe_table, table = mods
    from moe_variants import settings

    with settings("moe_table.NAME='NVIDIA H200'"):
        assert moe_table.NAME == "NVIDIA H200"
        assert triton_moe.tile_config(8, CUDA) == table["NVIDIA H200"]["8"]
    assert moe_table.NAME is None


def test_use_refuses_an_unknown_name_at_once_and_sets_a_known_one(mods, monkeypatch):
    triton_moe, moe_table, table = mods
    monkeypatch.setattr(moe_table, "NAME", None)  # restored after: use() sets the global
    with pytest.raises(ValueError, match="'H200' is not in kernels/moe_configs.json"):
        moe_table.use("H200")
    assert moe_table.NAME is None  # a refused name is not kept
    moe_table.use("NVIDIA H200")
    assert triton_moe.tile_config(1, CUDA) == table["NVIDIA H200"]["8"]
