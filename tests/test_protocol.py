"""The control protocol at the boundary: message round trips, the decoder, the framing.

No daemon here: the decoder is fuzzed with hypothesis, and the session's frame cutter
(``Session.data_received``) is driven with a fake transport and arbitrary chunkings.
"""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offloadd import protocol as p
from offloadd.config import DaemonConfig
from offloadd.metrics import DaemonMetrics
from offloadd.service.limits import LimitGuard
from offloadd.service.session import Session

ids = st.lists(st.text(min_size=1, max_size=12), max_size=5)
rids = st.integers(min_value=0, max_value=2**63 - 1)
REQUESTS = st.one_of(
    st.builds(p.Hello, rids, st.integers(0, 9), st.text(max_size=20), st.integers(0, 64),
              st.integers(1, 64), st.integers(0, 8), st.sampled_from(["cpu", "cuda:0"]),
              st.integers(0, 2**40)),
    ids.flatmap(lambda i: st.builds(p.Alloc, rids, st.just(i),
                                    st.lists(st.integers(0, 2**40), min_size=len(i),
                                             max_size=len(i)),
                                    st.lists(st.sampled_from(p.DTYPES), min_size=len(i),
                                             max_size=len(i)))),
    st.builds(p.Acquire, rids, ids, st.sampled_from(["r", "w"])),
    st.builds(p.Release, rids, ids, st.booleans()),
    st.builds(p.Drop, rids, ids),
    st.builds(p.Prefetch, rids, ids, st.floats(0, 10)),
    st.builds(p.StepBegin, rids),
    st.builds(p.Flush, rids, st.none() | st.text(max_size=8)),
    st.builds(p.Stats, rids),
)
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=10) | st.binary(max_size=10) | st.sampled_from(["hello", "acquire", "r"]),
    lambda children: st.lists(children, max_size=6)
    | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=20,
)


@given(REQUESTS)
def test_every_request_round_trips_through_a_frame(request: p.Request) -> None:
    frame = p.encode_frame(request)
    (length,) = p.HEADER.unpack_from(frame)
    assert length == len(frame) - p.HEADER_NBYTES
    assert p.request_decoder.decode(frame[p.HEADER_NBYTES:]) == request


@settings(max_examples=500)
@given(st.binary(max_size=256))
def test_decoder_on_random_bytes_returns_a_request_or_a_msgspec_error(data: bytes) -> None:
    try:
        request = p.request_decoder.decode(data)
    except p.DECODE_ERRORS:
        return
    assert isinstance(request, p.Request)


def test_invalid_utf8_in_a_string_is_a_decode_error_the_daemon_expects() -> None:
    payload = msgspec.msgpack.encode(["stats", 1])
    bad = payload.replace(b"stats", b"st\x80ts")
    with pytest.raises(p.DECODE_ERRORS):
        p.request_decoder.decode(bad)
    session, transport = session_on_fake_transport()
    session.data_received(p.HEADER.pack(len(bad)) + bad)
    assert [(r.code, r.rid) for r in transport.replies()] == [("bad_frame", 0)]  # type: ignore


@settings(max_examples=500)
@given(msgpack_values)
def test_decoder_on_well_formed_msgpack_of_any_shape_fails_only_with_msgspec_errors(
        value: object) -> None:
    data = msgspec.msgpack.encode(value)
    try:
        request = p.request_decoder.decode(data)
    except p.DECODE_ERRORS:
        return
    assert isinstance(request, p.Request)


@pytest.mark.parametrize("value", [
    ["no_such_op", 1],  # unknown op
    ["acquire", 1, ["a"], "x"],  # a mode that is not r/w
    ["acquire", 1, "a", "r"],  # ids must be a list
    ["alloc", 1, ["a"], [1]],  # missing field
    ["stats"],  # no request id
    ["stats", "1"],  # request id of the wrong type
    {"type": "stats", "rid": 1},  # a map where the protocol uses arrays
])
def test_decoder_rejects_malformed_requests(value: object) -> None:
    with pytest.raises(msgspec.ValidationError):
        p.request_decoder.decode(msgspec.msgpack.encode(value))


def test_check_length_accepts_the_limit_and_rejects_one_more() -> None:
    p.check_length(p.MAX_FRAME_NBYTES)
    with pytest.raises(ValueError, match="exceeds"):
        p.check_length(p.MAX_FRAME_NBYTES + 1)


def test_check_ids_wants_parallel_lists_of_one_length() -> None:
    p.check_ids(["a", "b"], [1, 2], None, ["x", "y"])
    with pytest.raises(ValueError, match="2 ids but a parallel list of 1"):
        p.check_ids(["a", "b"], [1])


# -- the session's frame cutter, with a fake transport ----------------------------------


class FakeTransport:
    def __init__(self) -> None:
        self.written = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0  # the client reads every reply at once

    def replies(self) -> list[p.Reply]:
        out, view = [], bytes(self.written)
        while view:
            (length,) = p.HEADER.unpack_from(view)
            out.append(p.reply_decoder.decode(view[p.HEADER_NBYTES : p.HEADER_NBYTES + length]))
            view = view[p.HEADER_NBYTES + length :]
        return out


class FakeDaemon:
    def __init__(self) -> None:
        self.metrics = DaemonMetrics()
        self.config = DaemonConfig(socket="/nonexistent/offloadd.sock")
        self.sessions: set[Session] = set()
        self.limits = LimitGuard(self.config.limits(), self.metrics)


def session_on_fake_transport() -> tuple[Session, FakeTransport]:
    session = Session(FakeDaemon(), 1)  # type: ignore[arg-type]
    transport = FakeTransport()
    session.transport = transport  # type: ignore[assignment]
    return session, transport


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


GARBAGE_FRAME = p.HEADER.pack(5) + b"\xc1\xc1\xc1\xc1\xc1"  # 0xc1 is never valid msgpack


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.booleans(), min_size=1, max_size=30),
       st.lists(st.integers(0, 10_000), max_size=40))
def test_any_chunking_of_a_stream_yields_one_reply_per_frame_in_order(
        garbage: list[bool], cuts: list[int]) -> None:
    """Frames split anywhere across reads (or many in one read) are cut exactly."""
    session, transport = session_on_fake_transport()
    stream = b"".join(GARBAGE_FRAME if bad else p.encode_frame(p.Stats(rid + 1))
                      for rid, bad in enumerate(garbage))
    for piece in chunked(stream, cuts):
        session.data_received(piece)
    replies = transport.replies()
    # Before hello every decodable request is answered no_session with its own rid;
    # an undecodable frame is answered bad_frame with rid 0; the connection stays open.
    assert [(r.code, r.rid) for r in replies] == [  # type: ignore[attr-defined]
        ("bad_frame", 0) if bad else ("no_session", rid + 1) for rid, bad in enumerate(garbage)
    ]
    assert not transport.closed
    assert session.buffer == b""


@given(st.integers(p.MAX_FRAME_NBYTES + 1, 2**32 - 1), st.binary(max_size=64))
def test_an_oversize_length_prefix_is_answered_once_and_closes(length: int,
                                                               rest: bytes) -> None:
    session, transport = session_on_fake_transport()
    session.data_received(p.encode_frame(p.Stats(7)) + p.HEADER.pack(length) + rest)
    session.data_received(p.encode_frame(p.Stats(8)))  # after the close: never answered
    replies = transport.replies()
    assert [(r.code, r.rid) for r in replies] == [  # type: ignore[attr-defined]
        ("no_session", 7), ("bad_frame", 0)]
    assert transport.closed


def test_a_partial_frame_waits_for_its_remaining_bytes() -> None:
    session, transport = session_on_fake_transport()
    frame = p.encode_frame(p.Stats(3))
    session.data_received(frame[:2])
    session.data_received(frame[2:-1])
    assert transport.written == b""
    session.data_received(frame[-1:])
    assert [r.rid for r in transport.replies()] == [3]


def test_the_client_imports_only_the_protocol_and_errors_of_the_daemon() -> None:
    """The dtype table lives next to the protocol, and the compact moment formats (the
    spec and its torch codec, which checkpoints and resharding read) are shared data
    formats too: the rank side never loads the daemon's optimizer service (or any other
    daemon component) to talk to it."""
    import subprocess
    import sys

    code = ("import sys, trainer.client; "
            "print(sorted(m for m in sys.modules if m.startswith('offloadd')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=120).stdout
    assert loaded.strip() == ("['offloadd', 'offloadd.errors', 'offloadd.formats', "
                              "'offloadd.moment_codec', 'offloadd.protocol']"), loaded
