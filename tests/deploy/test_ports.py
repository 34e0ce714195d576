"""The launcher's port picks: outside the kernel's ephemeral range (where an outgoing
connection can take a port between the pick and the child's bind), free, never twice."""

from __future__ import annotations

import socket
from contextlib import ExitStack

import pytest

from deploy import ports


@pytest.fixture(autouse=True)
def fresh_issued(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_issued", set())


def test_the_pick_range_avoids_the_ephemeral_range() -> None:
    assert ports.pick_range((32768, 60999)) == range(10000, 32768)
    assert ports.pick_range((1024, 40000)) == range(40001, 65536)
    assert len(ports.pick_range((10000, 65535))) == 0  # no room: free_port falls back


def test_picked_ports_are_outside_this_machines_ephemeral_range_and_distinct() -> None:
    lo, hi = ports.ephemeral_range()
    picked = [ports.free_port() for _ in range(200)]
    assert len(set(picked)) == 200
    if len(ports.pick_range((lo, hi))) > 1000:  # else no room: the kernel's picks, as before
        assert all(not lo <= p <= hi for p in picked), (lo, hi, sorted(picked)[:5])
    for p in picked:  # each one free now, as the child will bind it
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_bound_port_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    lo, _ = ports.ephemeral_range()
    base = lo - 2000  # a 128-port span outside the range; half of it held by listeners
    monkeypatch.setattr(ports, "pick_range", lambda _e: range(base, base + 128))
    with ExitStack() as stack:
        held = set()
        for p in range(base, base + 128, 2):
            s = stack.enter_context(socket.socket())
            held.add(p)
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                continue  # taken already: just as good
            s.listen()
        picked = [ports.free_port() for _ in range(30)]
    assert not held & set(picked)
    assert len(set(picked)) == 30


def test_a_run_of_ports_is_free_and_consecutive() -> None:
    base = ports.free_run(4)
    with ExitStack() as stack:
        for p in range(base, base + 4):
            stack.enter_context(socket.socket()).bind(("0.0.0.0", p))
    assert base + 3 < ports.ephemeral_range()[0] or base > ports.ephemeral_range()[1]


def test_with_no_room_outside_the_range_the_kernel_picks_never_twice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    picked = [ports.free_port() for _ in range(300)]
    assert len(set(picked)) == 300
    with pytest.raises(RuntimeError, match="no run of 4 free ports"):
        ports.free_run(4)


def test_an_unreadable_range_falls_back_to_the_default(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert ports.ephemeral_range(str(tmp_path / "none")) == (32768, 60999)
    (tmp_path / "bad").write_text("x y\n")
    assert ports.ephemeral_range(str(tmp_path / "bad")) == (32768, 60999)
