"""The router's phase table is executable: every listed edge is accepted and every other
refused, reports never move a run back, and only a new placement goes backward."""

from __future__ import annotations

import itertools

import pytest

from router.requests.run_phase import PHASE_EDGES, BadPhase, RunPhase, check_phase

P = RunPhase


def test_every_listed_edge_is_accepted_and_every_other_refused() -> None:
    refused = 0
    for old, new in itertools.product(P, P):
        if (old, new) in PHASE_EDGES:
            check_phase(old, new)
        else:
            refused += 1
            with pytest.raises(BadPhase, match=f"{old.name} -> {new.name}"):
                check_phase(old, new)
    assert refused > len(PHASE_EDGES)  # the table is a choice, not every pair


def test_backward_edges_only_return_to_placed_and_finished_is_final() -> None:
    backward = [(a, b) for a, b in PHASE_EDGES if b <= a and not b.finished]
    assert backward and all(b is P.PLACED for _, b in backward)
    assert not [e for e in PHASE_EDGES if e[0].finished]
    assert (P.QUEUED, P.FINISHED_STOPPED) not in PHASE_EDGES  # nothing ran: no normal end
    for p in P:
        if not p.finished:
            assert (p, P.FINISHED_ABORTED) in PHASE_EDGES
            assert (p, P.FINISHED_ERROR) in PHASE_EDGES


def test_the_forward_walks_a_report_order_allows() -> None:
    walks = [
        [P.QUEUED, P.PLACED, P.PAIRED, P.TOKEN0, P.KV_LANDED, P.DECODING, P.FINISHED_LENGTH],
        [P.QUEUED, P.PLACED, P.TOKEN0, P.DECODING, P.FINISHED_STOPPED],  # token 0 first
        [P.QUEUED, P.PLACED, P.DECODING, P.FINISHED_STOPPED],  # colocated
        [P.QUEUED, P.PLACED, P.PAIRED, P.TOKEN0, P.PLACED, P.PAIRED],  # migrated
    ]
    for walk in walks:
        for old, new in itertools.pairwise(walk):
            check_phase(old, new)
    with pytest.raises(BadPhase):
        check_phase(P.QUEUED, P.DECODING)  # tokens before any placement: a bug
