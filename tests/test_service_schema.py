"""The schema of ``atoll syncer``'s messages: every record round-trips through its JSON; what is not a record
(a 4,300-digit integer, JSON nested 100,000 deep, an upload id or a range list over its limit) is refused at
parse, and the server refuses it with INVALID_ARGUMENT naming the field, counted as ``schema``, logged at a
bounded rate."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import grpc
import pytest
from conftest import service_clients as _clients

from atoll.runtime.service import schema, wire

GRANT = schema.Grant(island=1, session=2, tokens=640, epoch=1, seq=3, run="ab" * 8, mac="0" * 64)
HUGE = int("9" * 4300)  # as many digits as Python's int() takes from a string

#: per method, a request and a reply of each shape it takes
SAMPLES: dict[str, list[schema.Record]] = {
    "Join": [schema.JoinRequest(numels=[5, 7]), schema.JoinRequest(numels=[5, 7], shards=[0, 1]),
             schema.JoinRequest(numels=[5], settings={"seed": "0", "codec": '"int4"'}, digest="0f" * 32),
             schema.JoinReply(versions=[0, 3], steps=10, session=2),
             schema.JoinReply(versions=[0, 3], steps=10, session=2, grant=GRANT)],
    "Hello": [schema.HelloRequest(numels=[5], shards=[0], shard=0, grant=GRANT),
              schema.HelloRequest(numels=[5], shard=0, grant=None), schema.HelloReply(shard=1, fragments=[1, 3])],
    "ReserveSteps": [schema.ReserveStepsRequest(),
                     schema.ReserveStepsRequest(n=5, used=3, loss=2.5, lr=1e-3, session=2),
                     schema.ReserveStepsReply(granted=0, wait=True), schema.ReserveStepsReply(granted=5, grant=GRANT)],
    "Buffered": [schema.BufferedRequest(fragment=1, wait_s=5.0, session=3), schema.BufferedRequest(),
                 schema.BufferedReply(buffered=[0, 1])],
    "Heartbeat": [schema.HeartbeatRequest(), schema.HeartbeatRequest(session=4), schema.HeartbeatReply(spent=False)],
    "UploadStatus": [schema.UploadStatusRequest(upload="1.0.3.1"), schema.ReceivedReply(received=1 << 20)],
    "Push": [schema.PushRequest(slices=["a", "b"], fragment=1, tokens=640, base_version=3, session=2, round_s=1.5,
                                grant=GRANT),
             schema.PushRequest(slices=["a"], fragment=0, tokens=0, base_version=0, session=1, round_s=None),
             schema.PushReply(accepted=True, answered=False, version=None),
             schema.PushReply(accepted=False, answered=True, version=4)],
    "PullMeta": [schema.FragmentRequest(fragment=2), schema.VersionReply(version=9)],
    "Leave": [schema.LeaveRequest(used=4, steps=20, compute_s=1.25, bytes_sent=1e6, last_loss=3.5, codec_s=0.5,
                                  resets=0, skipped_steps=1, session=2), schema.LeaveRequest(),
              schema.LeaveReply(ok=True, returned=3), schema.LeaveReply(ok=True, returned=0, grant=GRANT)],
    "Finish": [schema.Empty(),
               schema.FinishReply(shard=1, fragments=[1], versions=[4], numel=1000, stats={"commits": 4, "x": [1.5]},
                                  merged_tokens=1280.0, restarts=0, refused_calls={"shard": 2})],
    "Close": [schema.Empty(), schema.OkReply(ok=True)],
    "Upload": [schema.UploadHeader(upload="u" * schema.MAX_ID, fragment=0, ranges=[(0, 4), (6, 9)], size=40),
               schema.UploadHeader(upload="u", fragment=0, ranges=[(0, 4)], size=40, offset=12),
               schema.ReceivedReply(received=40)],
    "Download": [schema.DownloadRequest(fragment=1), schema.DownloadRequest(fragment=1, ranges=[(2, 3)], version=4,
                                                                            offset=7),
                 schema.DownloadHeader(version=4, size=100, offset=0)],
}


def test_every_message_round_trips_through_its_json() -> None:
    assert set(SAMPLES) == set(schema.REQUESTS) == set(schema.REPLIES) == {*wire.CONTROL, "Upload", "Download"}
    for name, records in SAMPLES.items():
        kinds = {type(r) for r in records}
        assert {schema.REQUESTS[name], schema.REPLIES[name]} <= kinds, name  # each method's both records
        for record in records:
            assert schema.parse(type(record), schema.encode(record)) == record, (name, record)


def test_an_islands_losses_travel_as_they_are_nan_and_infinity_included() -> None:
    """A diverged island reports a NaN or infinite loss (Leave, ReserveSteps): not a reason to refuse its call."""
    for loss in (math.nan, math.inf, -math.inf):
        got = schema.parse(schema.LeaveRequest, schema.encode(schema.LeaveRequest(last_loss=loss, steps=3)))
        assert got.steps == 3 and (math.isnan(got.last_loss) if math.isnan(loss) else got.last_loss == loss)


def _push(**fields: object) -> bytes:
    base = {"slices": ["a"], "fragment": 0, "tokens": 1, "base_version": 0, "session": 1}
    return wire.dumps({**base, **fields})


@pytest.mark.parametrize(("model", "data", "field"), [
    (schema.PushRequest, _push(session=HUGE), "session"),
    (schema.PushRequest, _push(session=-1), "session"),
    (schema.PushRequest, _push(tokens=1.0), "tokens"),   # a float is no int
    (schema.PushRequest, _push(tokens=True), "tokens"),  # nor a bool
    (schema.PushRequest, _push(tokens="1"), "tokens"),   # nor a string
    (schema.PushRequest, _push(round_s=-1.0), "round_s"),
    (schema.PushRequest, _push(slices=[]), "slices"),
    (schema.PushRequest, _push(slices=["x"] * (schema.MAX_SLICES + 1)), "slices"),
    (schema.PushRequest, _push(slices=["x" * (schema.MAX_ID + 1)]), "slices.0"),
    (schema.PushRequest, _push(extra=1), "extra"),
    (schema.PushRequest, _push(grant={**GRANT.model_dump(), "island": HUGE}), "grant.island"),
    (schema.UploadStatusRequest, wire.dumps({"upload": "u" * (schema.MAX_ID + 1)}), "upload"),
    (schema.UploadHeader, wire.dumps({"upload": "u", "fragment": 0, "size": 8,
                                      "ranges": [[i, i + 1] for i in range(wire.MAX_RANGES + 1)]}), "ranges"),
    (schema.DownloadRequest, wire.dumps({"fragment": 0, "ranges": [[0, HUGE]]}), "ranges.0.1"),
    (schema.BufferedRequest, wire.dumps({"wait_s": 10 ** 400}), "wait_s"),
    (schema.JoinRequest, wire.dumps({"numels": [1] * (schema.MAX_FRAGMENTS + 1)}), "numels"),
    (schema.JoinRequest, wire.dumps({"numels": [1], "settings": {"seed": 0}}), "settings.seed"),  # a text
    (schema.JoinRequest,
     wire.dumps({"numels": [1], "settings": {f"s{i}": "0" for i in range(schema.MAX_SETTINGS + 1)}}), "settings"),
    (schema.JoinRequest, wire.dumps({"numels": [1], "settings": {"x" * (schema.MAX_SETTING_NAME + 1): "0"}}),
     "settings.xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx.[key]"),
    (schema.JoinRequest, wire.dumps({"numels": [1], "settings": {"a": "1" * (schema.MAX_SETTING_VALUE + 1)}}),
     "settings.a"),
    (schema.JoinRequest, wire.dumps({"numels": [1], "settings": {f"s{i}": "1" * 8000 for i in range(9)}}),
     "settings"),  # each value within its bound, all of them together not
    (schema.JoinRequest, wire.dumps({"numels": [1], "digest": "xyz"}), "digest"),
    (schema.HeartbeatRequest, wire.dumps({"session": -1}), "session"),
    (schema.LeaveRequest, wire.dumps({"session": HUGE}), "session"),
    (schema.JoinRequest, b"[1, 2]", "message"),
    (schema.JoinRequest, b"{not json", "message"),
])
def test_what_is_not_its_record_is_refused_at_parse_naming_the_field(model: type[schema.Record], data: bytes,
                                                                     field: str) -> None:
    with pytest.raises(schema.SchemaError) as e:
        schema.parse(model, data)
    assert str(e.value).startswith(f"{field}: ") and "\n" not in str(e.value), str(e.value)
    assert len(str(e.value)) <= 200


def test_json_nested_100000_deep_is_refused_before_it_is_parsed() -> None:
    deep = b'{"numels":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(schema.SchemaError, match="nested deeper than"):
        schema.parse(schema.JoinRequest, deep)
    with pytest.raises(ValueError, match="nested deeper than"):
        wire.loads(deep)
    with pytest.raises(ValueError, match="nested deeper than"):
        wire.check_depth(b"[" * (wire.MAX_DEPTH + 1))
    wire.check_depth(b"[" * wire.MAX_DEPTH + b"]" * wire.MAX_DEPTH)
    assert wire.loads(b'{"a": "[[[[{{{{\\"[[[[", "b": [[1]]}') == {"a": '[[[[{{{{"[[[[', "b": [[1]]}


def _refused(call: Callable[..., object], *args: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call(*args)
    return e.value


def test_the_server_refuses_what_fails_the_schema_in_one_line_counted_and_logged_at_a_bounded_rate(
        syncer, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001, F811
    state, address, creds = syncer()
    lead, rank1, _, session, _ = _clients(state, address, creds)
    numels = state.service.syncer.numels
    control = lead.control.unary_unary(wire.method("Push"))
    md = lead.metadata

    def raw(channel: grpc.Channel, name: str, data: bytes) -> bytes:
        return channel.unary_unary(wire.method(name))(data, metadata=md, timeout=10)

    bad_push = {"slices": ["a"], "fragment": 0, "tokens": 1, "base_version": 0, "session": HUGE}
    with caplog.at_level(logging.WARNING, logger="atoll.syncer"):
        e = _refused(control, wire.dumps(bad_push), None, None)  # no credential: refused before its body is read
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED
        huge_island = ((wire.ISLAND_KEY, "9" * 5000), (wire.CREDENTIAL_KEY, creds[0]))  # not even int()'s
        e = _refused(control, wire.dumps(bad_push), None, huge_island)
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED and e.details() == "refused: island"
        e = _refused(raw, lead.control, "Push", wire.dumps(bad_push))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("Push: session: "), e.details()
        grant = {**GRANT.model_dump(), "island": HUGE}  # an island index of 4,300 digits
        e = _refused(raw, lead.control, "Hello", wire.dumps({"numels": numels, "shard": 0, "grant": grant}))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("Hello: grant.island: ")
        deep = b'{"numels":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        e = _refused(raw, lead.control, "Join", deep)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "nested deeper" in e.details()
        e = _refused(raw, rank1.bulk, "UploadStatus", wire.dumps({"upload": "u" * (schema.MAX_ID + 1)}))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("UploadStatus: upload: ")
        # the bulk calls' headers: an upload id and a range list over their limits
        upload = rank1.bulk.stream_unary(wire.method("Upload"))
        header = {"upload": "u" * (schema.MAX_ID + 1), "fragment": 0, "ranges": [[0, numels[0]]], "size": 8}
        e = _refused(lambda: upload(iter([wire.dumps(header)]), metadata=md, timeout=10))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("Upload: upload: ")
        # a stream that ends before its header (what a killed island's upload can look like to the server) is a
        # cut, answered but not counted: a killed island is no refusal
        e = _refused(lambda: upload(iter([]), metadata=md, timeout=10))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.details() == "upload: the stream ended before its header"
        download = rank1.bulk.unary_stream(wire.method("Download"))
        ranges = [[i, i + 1] for i in range(wire.MAX_RANGES + 1)]
        e = _refused(lambda: list(download(wire.dumps({"fragment": 0, "ranges": ranges}), metadata=md, timeout=10)))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("Download: ranges: ")
    assert state.refused_calls == {"no_credential": 1, "island": 1, "schema": 6}
    lines = [r for r in caplog.records if "schema" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # six refusals, one line (the rest counted in the next)
    assert "\n" not in lines[0].getMessage()
    # nothing refused reached the syncer; the island's own calls, encoded from the same records, still pass
    assert state.service.syncer.rejected_updates == 0 and state.service.syncer.version(0) == 0
    assert lead.call("PullMeta", schema.FragmentRequest(fragment=0)) == {"version": 0}
    with pytest.raises(TypeError, match="FragmentRequest"):
        lead.call("Buffered", schema.FragmentRequest(fragment=0))
    assert session >= 1


def test_the_client_checks_each_reply_against_its_record() -> None:
    from atoll.runtime.service.client import _reply

    assert _reply("Push", b'{"accepted":true,"answered":false,"version":null}') == {
        "accepted": True, "answered": False, "version": None}
    with pytest.raises(RuntimeError, match=r"^syncer: its reply to Push is not a PushReply \(accepted: "):
        _reply("Push", b'{"accepted":1,"answered":false}')
    with pytest.raises(RuntimeError, match="nested deeper"):
        _reply("Heartbeat", b"[" * 100_000)
