"""The tensor-parallel rank channel's messages (engine.parallel.messages): every type
round-trips through the checked codec, in its own direction only; a malformed one is a
MessageError naming its kind and field."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from engine.codec import MessageError
from engine.parallel import messages as m
from engine.parallel.dp_plan import DPPlan
from engine.parallel.graph_step import GraphStep
from engine.parallel.step_plan import StepPlan

PLAN = StepPlan(input_ids=[5, 0, 9, 2**40], positions=[0, 1, 2, 3], slots=[8, 9, 10, 11],
                cu_seqlens_q=[0, 3, 4], seq_lens=[3, 4], block_tables=[[2, 0], [3, 4]],
                sample_at=[2, 3], fix_at=[1], fix_from=[0])
GRAPH = GraphStep(padded=4, ints=np.arange(20, dtype=np.int64).reshape(5, 4),
                  temps=np.array([0.0, 0.5, 1.0, 0.0], dtype=np.float32),
                  edit_at=np.array([3], dtype=np.int64), edit_to=np.array([7], dtype=np.int32),
                  copy_prev=2, head=False, logit_rows=[0, 2], batch=3, samples=True)
TO_SAMPLES = [m.KvStart((4, 2, 2, 4, 1, 8), "bfloat16"),
              m.KvStart((4, 2, 2, 4, 1, 8), "float8_e4m3fn", (0.5, 0.25)),
              m.GraphsStart(8, 16, True), PLAN,
              DPPlan(PLAN, 4, [2, 0], 1), DPPlan(None, 4, [2, 0], 1),
              dataclasses.replace(PLAN, sample_at=[], fix_at=[], fix_from=[]), GRAPH,
              dataclasses.replace(GRAPH, logit_rows=None), m.Attach("pkg.mod:fn", b"\x01\x02"),
              m.KvCopy((3, 0, 7)), m.KvCopy(()), m.SideMessage(b"body"), m.Stop()]
FROM_SAMPLES = [m.Hello(), m.KvReady(), m.GraphsReady(), m.Attached(b"info"),
                m.AttachFailed("ValueError: no"), m.SideReport(b"r")]


def _equal(a: object, b: object) -> bool:
    if type(a) is not type(b):
        return False
    for f in dataclasses.fields(a):  # type: ignore[arg-type]
        x, y = getattr(a, f.name), getattr(b, f.name)
        if dataclasses.is_dataclass(x):
            if not _equal(x, y):
                return False
        elif isinstance(x, np.ndarray):
            if not (isinstance(y, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y)):
                return False
        elif (list(map(list, x)) if f.name == "block_tables" else x) != \
                (list(map(list, y)) if f.name == "block_tables" else y):
            return False
    return True


def test_every_message_type_is_sampled() -> None:
    assert {type(s) for s in TO_SAMPLES} == set(m.TO_FOLLOWER.by_class)
    assert {type(s) for s in FROM_SAMPLES} == set(m.FROM_FOLLOWER.by_class)


@pytest.mark.parametrize("msg", TO_SAMPLES, ids=lambda s: type(s).__name__)
def test_to_follower_round_trips(msg: object) -> None:
    back = m.TO_FOLLOWER.decode(m.TO_FOLLOWER.encode(msg))
    assert _equal(back, msg), (back, msg)
    if isinstance(back, GraphStep):  # the follower copies them into torch buffers
        assert back.ints.flags.writeable


@pytest.mark.parametrize("msg", FROM_SAMPLES, ids=lambda s: type(s).__name__)
def test_from_follower_round_trips(msg: object) -> None:
    assert m.FROM_FOLLOWER.decode(m.FROM_FOLLOWER.encode(msg)) == msg


def test_a_message_is_only_read_in_its_own_direction() -> None:
    with pytest.raises(MessageError, match="kind: unknown message kind 'hello'"):
        m.TO_FOLLOWER.decode(m.FROM_FOLLOWER.encode(m.Hello()))
    with pytest.raises(MessageError, match="kind: unknown message kind 'stop'"):
        m.FROM_FOLLOWER.decode(m.TO_FOLLOWER.encode(m.Stop()))


def _raw(*items: object) -> bytes:
    out: bytes = msgpack.packb(list(items), use_bin_type=True)
    return out


def _fields(msg: object) -> list:
    return msgpack.unpackb(m.TO_FOLLOWER.encode(msg), raw=False)[1:]


def _with(msg: object, i: int, value: object) -> bytes:
    f = _fields(msg)
    f[i] = value
    return _raw(type(msg).KIND, *f)  # type: ignore[attr-defined]


BAD = [
    (_raw("kv", [4, "x"], "float32"), "kv.shape"),
    (_raw("kv", [4, 2]), "kv.dtype: missing field"),
    (_raw("graphs", 8, 16, "yes"), "graphs.use_graphs"),
    (_with(PLAN, 0, [5, 0]), "plan.input_ids"),  # a list where packed int64 bytes go
    (_with(PLAN, 1, b"\x00" * 7), "plan.positions"),  # not a whole number of int64s
    (_with(PLAN, 5, [b"\x00" * 8, 3]), "plan.block_tables[1]"),
    (_with(GRAPH, 1, ["int64", [5, 4], b"\x00" * 8]), "graph.ints"),  # bytes short of shape
    (_with(GRAPH, 2, ["object", [4], b""]), "graph.temps"),  # a dtype that never travels
    (_with(GRAPH, 6, 1), "graph.head"),
    (_raw("attach", "pkg.mod:fn", "not bytes"), "attach.args"),
    (_raw("side"), "side.body: missing field"),
    (_raw("stop", 1), "stop: 1 fields, expected at most 0"),
    (_raw("nope"), "kind: unknown message kind 'nope'"),
    (b"\xc1", "message: not a valid msgpack message"),
    (_raw(7), "message: expected a list [kind, *fields]"),
]


@pytest.mark.parametrize("data,where", BAD, ids=[w for _, w in BAD])
def test_a_malformed_message_names_its_kind_and_field(data: bytes, where: str) -> None:
    with pytest.raises(MessageError) as e:
        m.TO_FOLLOWER.decode(data)
    assert str(e.value).startswith(where), str(e.value)


def test_a_malformed_report_names_its_kind_and_field() -> None:
    with pytest.raises(MessageError, match=r"^attached\.info: expected bytes, got str"):
        m.FROM_FOLLOWER.decode(_raw("attached", "text"))
    with pytest.raises(MessageError, match=r"^attach-failed\.error: expected a string"):
        m.FROM_FOLLOWER.decode(_raw("attach-failed", 3))
