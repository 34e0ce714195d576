"""Run the fused MoE kernel with another card's tiles: ``moe_table.NAME``.

``kernels/moe_configs.json`` is keyed by the GPU's name. Cards without an entry read
"default", as the H100s that stood in for the H200 did from session 36 until session 50
gave them one. That entry has other tiles at every decode batch: 64-column gate/up and down
tiles where the H200's are 128, and at 65-256 tokens 32-row tiles where the H200's are 16.
So those H100 runs compared different grids with the H200's runs. At batch 1, V2-Lite's six
routed experts give 132 gate/up programs with the default tile and 66 with the H200's.

Importing this module wraps ``kernels.triton_moe._device_name``. While ``NAME`` is set,
the table is read under that name instead of the GPU's own, so a run on one card uses
another card's tiles:

    python3 bench/moe_bench.py ... --kernel-variants "moe_table.NAME='NVIDIA H200'"   # on an H100
    python3 bench/moe_bench.py ... --kernel-variants "moe_table.NAME='default'"       # on an H200
    python3 bench/moe_bench.py ... --moe-table 'NVIDIA H200'   # the whole run on those tiles

A name the table does not have raises (a typo would otherwise read "default" unseen).
Only the 16-bit or FP8 lookup by name changes; FP8 experts still look for "<NAME> fp8".
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import kernels.triton_moe as triton_moe

NAME: str | None = None  # the table entry to read (None: the GPU's own name)

_own: Callable[[torch.device], str] = triton_moe._device_name


def use(name: str | None) -> None:
    """Sets NAME for the rest of the process (moe_bench.py --moe-table), refusing at once
    a name the table lacks."""
    global NAME
    if name is not None:
        _check(name)
    NAME = name


def _check(name: str) -> None:
    known = sorted(triton_moe._config_table())
    if name not in known:
        raise ValueError(f"moe_table.NAME: {name!r} is not in kernels/moe_configs.json "
                         f"(its entries: {', '.join(known)})")


def _table_name(device: torch.device) -> str:
    if NAME is None or device.type != "cuda":
        return _own(device)
    _check(NAME)
    return NAME


# Chained, not guarded: a second copy of this module (imported under another name) wraps
# the first, and each consults its own NAME before handing on.
triton_moe._device_name = _table_name  # type: ignore[assignment]
