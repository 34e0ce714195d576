"""What rank 0 and the follower ranks' transfer endpoints say (transfer.tp_messages): every
type round-trips through the checked codec; a malformed one names its kind and field, and a
rank side given one keeps serving."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from engine.codec import MessageError
from engine.kv_layout import KVLayout
from transfer import TransferConfig, TransferNotice, TransferStatus
from transfer import tp_messages as t
from transfer.tp_rank_side import make_rank_side

LAYOUT = KVLayout("tiny", "float32", 4, 2, 2, 8, 16, tp_size=2)
NOTICE = TransferNotice("r1", 42, False, 36, seed=7, logprobs=((42, -0.5), (3, -1.25)))
TO = [t.RankSideArgs("consumer", "c0", LAYOUT, TransferConfig(backend="fake"), 7000),
      t.PushCmd("r1", ("tcp://a:1", "tcp://b:2"), (0, 1), (5, 6), 12.5),
      t.PushCmd("r2", (), (), (), None), t.FinishCmd("r1", NOTICE),
      t.FinishCmd("r1", dataclasses.replace(NOTICE, sent_ns=11)),  # stamped: it goes along
      t.FinishCmd("r2", TransferNotice("r2", 1, True, 4)), t.CancelCmd("r1", "aborted"),
      t.ReleaseCmd("r1"), t.ExpectCmd("r1", (5, 6), 3.0, 2), t.ExpectCmd("r1", (), None, None)]
FROM = [t.RankSideInfo("tcp://127.0.0.1:5000"), t.UpdateReport("r1", TransferStatus.DONE,
                                                               NOTICE, None),
        t.UpdateReport("r1", TransferStatus.FAILED, None, "peer gone"), t.ExpectedReport("r1"),
        # a consumer rank's DONE with the handoff's stamps, the notice's own included
        t.UpdateReport("r1", TransferStatus.DONE, dataclasses.replace(NOTICE, sent_ns=11),
                       None, 12, 13),
        t.StatsReport(1, 2, 4096)]


def test_every_message_type_is_sampled() -> None:
    assert {type(s) for s in TO} == set(t.TO_RANK.by_class)
    assert {type(s) for s in FROM} == set(t.FROM_RANK.by_class)


@pytest.mark.parametrize("msg", TO, ids=lambda s: type(s).__name__)
def test_to_rank_round_trips(msg: object) -> None:
    back = t.TO_RANK.decode(t.TO_RANK.encode(msg))
    assert back == msg
    if isinstance(back, t.FinishCmd):  # == leaves the notice's stamp out
        assert isinstance(msg, t.FinishCmd) and back.notice.sent_ns == msg.notice.sent_ns


@pytest.mark.parametrize("msg", FROM, ids=lambda s: type(s).__name__)
def test_from_rank_round_trips(msg: object) -> None:
    back = t.FROM_RANK.decode(t.FROM_RANK.encode(msg))
    assert back == msg
    if isinstance(back, t.UpdateReport) and back.notice is not None:  # == leaves it out
        assert isinstance(msg, t.UpdateReport) and msg.notice is not None
        assert back.notice.sent_ns == msg.notice.sent_ns
    if isinstance(back, t.UpdateReport):
        assert type(back.status) is TransferStatus


def _raw(*items: object) -> bytes:
    out: bytes = msgpack.packb(list(items), use_bin_type=True)
    return out


def _fields(codec, msg: object) -> list:  # type: ignore[no-untyped-def]
    return msgpack.unpackb(codec.encode(msg), raw=False)[1:]


ARGS = _fields(t.TO_RANK, TO[0])
PLANES = [f.name for f in dataclasses.fields(KVLayout)].index("planes")
BAD_LAYOUT = [*ARGS[2][:PLANES], "x", *ARGS[2][PLANES + 1:]]
BAD_TO = [
    (_raw("args", "consumer", "c0", BAD_LAYOUT, ARGS[3], 0), "args.layout.planes"),
    (_raw("args", "consumer", "c0", ARGS[2], [*ARGS[3][:2], "p"], 0), "args.transfer.port"),
    (_raw("push", "r1", ["a", 2], [0], [5], None), "push.addresses[1]"),
    (_raw("push", "r1", ["a"], [0], ["5"], None), "push.dst"),
    (_raw("push", "r1", ["a"], [0], [5], "soon"), "push.deadline"),
    (_raw("finish", "r1", ["r1", "42", False, 36]), "finish.notice.first_token"),
    (_raw("finish", "r1", ["r1", 42, False, 36, None, [[42]]]), "finish.notice.logprobs[0]"),
    (_raw("cancel", "r1"), "cancel.reason: missing field"),
    (_raw("release", 1), "release.rid"),
    (_raw("expect", "r1", [5], None, "2"), "expect.source_tp"),
]
BAD_FROM = [
    (_raw("info", None), "info.address"),
    (_raw("update", "r1", 99, None, None), "update.status"),
    (_raw("update", "r1", 3, None, 5), "update.error"),
    (_raw("expected"), "expected.rid: missing field"),
    (_raw("stats", 1, 2, 3.5), "stats.payload_bytes"),
]


@pytest.mark.parametrize("data,where", BAD_TO, ids=[w for _, w in BAD_TO])
def test_a_malformed_command_names_its_kind_and_field(data: bytes, where: str) -> None:
    with pytest.raises(MessageError) as e:
        t.TO_RANK.decode(data)
    assert str(e.value).startswith(where), str(e.value)


@pytest.mark.parametrize("data,where", BAD_FROM, ids=[w for _, w in BAD_FROM])
def test_a_malformed_report_names_its_kind_and_field(data: bytes, where: str) -> None:
    with pytest.raises(MessageError) as e:
        t.FROM_RANK.decode(data)
    assert str(e.value).startswith(where), str(e.value)


def test_a_rank_side_given_a_malformed_message_keeps_serving() -> None:
    pool = torch.zeros(16, *LAYOUT.block_shape)
    args = t.RankSideArgs("consumer", "c", LAYOUT, TransferConfig(backend="fake"))
    side = make_rank_side(pool, 1, 2, t.TO_RANK.encode(args))
    try:
        info = t.FROM_RANK.decode(side.info())
        assert isinstance(info, t.RankSideInfo) and info.address
        side.on_message(_raw("expect", "r1", ["x"], None, None))  # dropped, logged
        side.on_message(t.TO_RANK.encode(t.ExpectCmd("r2", (1, 2), None, 2)))
        reports = [t.FROM_RANK.decode(b) for b in side.poll()]
        assert t.ExpectedReport("r2") in reports and t.ExpectedReport("r1") not in reports
    finally:
        side.close()


def test_a_rank_side_refuses_args_of_another_kind() -> None:
    with pytest.raises(ValueError, match="expected 'args', got 'release'"):
        make_rank_side(torch.zeros(1), 1, 2, t.TO_RANK.encode(t.ReleaseCmd("r1")))
