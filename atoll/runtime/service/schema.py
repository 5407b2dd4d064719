"""The schema of ``atoll syncer``'s messages: one typed record per request and reply of each gRPC method.

JSON stays the encoding at the edge (:func:`encode`, :func:`parse`); everything between the edge and the
syncer is one of these records. Each is a pydantic model with ``extra="forbid"``, parsed strictly (a string
is not an int, a float is not an int, a bool is not a number), and every field is bounded, so what a stranger
sends is refused at parse, before any handler sees it:

- every integer is ``0 <= x < 2**53`` (:data:`MAX_INT`: a 4,300-digit session or island index is refused,
  never compared or stored);
- strings and lists have lengths (an upload id at most :data:`MAX_ID` characters, a commit at most
  :data:`MAX_SLICES` slices, a slice at most :data:`~atoll.runtime.service.wire.MAX_RANGES` ranges, the
  fragments' lists at most :data:`MAX_FRAGMENTS`);
- a JSON text nested deeper than :data:`~atoll.runtime.service.wire.MAX_DEPTH` is refused before it is
  parsed (:func:`~atoll.runtime.service.wire.check_depth`), so no parser recurses on it.

What the schema cannot know (an island index below the run's islands, a fragment of the run's, ranges inside
a fragment's values) the server checks against the run. A request that fails the schema is refused with
INVALID_ARGUMENT naming the field (:class:`SchemaError`, one line). The islands' client encodes its requests
from the same records (:meth:`SyncerClient.call <atoll.runtime.service.client.SyncerClient.call>`).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from atoll.runtime.service import wire

#: every integer of a message is below this (JSON's exact integers in a double)
MAX_INT = 1 << 53
#: the longest upload id (an island's are 32 hex digits, or ``session.fragment.exchange.rank``)
MAX_ID = 128
#: slices one commit (``Push``) may list
MAX_SLICES = 4096
#: the most fragments a run may have (the lengths of ``numels``, ``shards``, ``versions``)
MAX_FRAGMENTS = 1 << 16
#: the longest free string of a message (a grant's run fingerprint and MAC)
MAX_TEXT = 256
#: the most settings a run's record may hold (:mod:`atoll.config.run_record`), the longest name of one, the
#: longest value (its JSON text), and the most characters of all its values together
MAX_SETTINGS, MAX_SETTING_NAME, MAX_SETTING_VALUE, MAX_RECORD_CHARS = 512, 64, 16384, 1 << 16

Int = Annotated[int, Field(ge=0, lt=MAX_INT)]
#: a number of seconds: finite, >= 0
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
#: a number an island reports (a loss may be NaN or infinite: a diverged island says so)
Reported = float | None
#: a figure an island counts (seconds of compute, bytes): finite, >= 0, below :data:`MAX_INT` (a huge JSON integer
#: reads as an infinite float: refused)
Figure = Annotated[float, Field(ge=0, le=MAX_INT, allow_inf_nan=False)]
#: a share of a round in [0, 1), finite: how far behind the fragment's previous, larger merge an island's merged
#: push arrived (``realign_pushes``: :attr:`Pull.realign <atoll.strategies.decoupled.protocol.Pull.realign>`)
Share = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]
UploadId = Annotated[str, Field(min_length=1, max_length=MAX_ID)]
Text = Annotated[str, Field(max_length=MAX_TEXT)]
Ints = Annotated[tuple[Int, ...], Field(max_length=MAX_FRAGMENTS)]
#: a run's record (:func:`~atoll.config.run_record.run_record`): setting name -> its canonical JSON text
Settings = Annotated[dict[Annotated[str, Field(min_length=1, max_length=MAX_SETTING_NAME)],
                          Annotated[str, Field(max_length=MAX_SETTING_VALUE)]], Field(max_length=MAX_SETTINGS)]
#: a record's digest (:func:`~atoll.config.run_record.digest`): 64 hex digits
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
#: an island's session (from its join): every control call of an island carries it, so the syncer refuses the
#: calls of a session a newer join superseded (``stale_session``)
Session = Int | None
#: a slice's ranges of a fragment's element order: ``[[start, stop], ...]`` (ascending and inside the fragment:
#: the server's check, :func:`~atoll.runtime.service.wire.parse_ranges`)
Ranges = Annotated[tuple[tuple[Int, Int], ...], Field(min_length=1, max_length=wire.MAX_RANGES)]


class Record(BaseModel):
    """A message of the service: no field it does not name, immutable; parsed from the wire strictly
    (:func:`parse`), built in Python as pydantic does (a list where a tuple is declared is taken)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Empty(Record):
    """A request with no fields (``Finish``, ``Close``)."""


class Grant(Record):
    """The coordinator's signed grant of an island as it travels
    (:meth:`Grant.signed <atoll.runtime.service.syncer_shards.Grant.signed>`; verified by the shard, not here)."""

    island: Int
    session: Int
    tokens: Int
    epoch: Int
    seq: Int
    run: Text
    mac: Text


# --- requests -----------------------------------------------------------------------------------------------
class JoinRequest(Record):
    """``Join``: the island's fragments' sizes and the fragment -> shard map it routes by (default: all shard 0);
    the record of its run's settings and its digest (:mod:`atoll.config.run_record`: compared with the syncer's,
    a difference refused as ``settings``; an island of this atoll always sends them); ``job``: the island job's
    id, the same for every attempt of one torchrun launch (a job whose session a newer job superseded is refused
    at its next join, so its torchrun restarts do not supersede the newer job in turn)."""

    numels: Ints
    shards: Ints | None = None
    settings: Settings | None = None
    digest: Digest | None = None
    job: Annotated[str, Field(min_length=1, max_length=MAX_ID)] | None = None

    @field_validator("settings")
    @classmethod
    def _record_size(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and sum(len(k) + len(v) for k, v in value.items()) > MAX_RECORD_CHARS:
            raise ValueError(f"the record of the run's settings is longer than {MAX_RECORD_CHARS} characters")
        return value


class HelloRequest(JoinRequest):
    """``Hello``: as ``Join``, with the shard the island thinks it dialed and the coordinator's grant."""

    shard: Int
    grant: Grant | None = None


class ReserveStepsRequest(Record):
    """``ReserveSteps``: a lease of ``n`` steps; ``used``: the steps of its session taken; ``received``: the steps
    of its session granted to it so far (a grant whose reply was lost is granted again); its last loss and lr;
    its session's ``compute_s``, ``bytes_sent`` and ``bytes_received`` so far (summed over its sessions for the
    run's summary)."""

    n: Annotated[int, Field(ge=1, lt=1 << 20)] = 1
    used: Int | None = None
    received: Int | None = None
    loss: Reported = None
    lr: Reported = None
    session: Session = None
    compute_s: Figure | None = None
    bytes_sent: Figure | None = None
    bytes_received: Figure | None = None


class BufferedRequest(Record):
    """``Buffered``: wait up to ``wait_s`` (capped at ``wire.MAX_WAIT_S``) for ``fragment``'s push to merge."""

    fragment: Int | None = None
    wait_s: Seconds = 0.0
    session: Session = None


class HeartbeatRequest(Record):
    """``Heartbeat``: the island's session (its calls of a superseded session are refused)."""

    session: Session = None


class FragmentRequest(Record):
    """``PullMeta``: one fragment of the run."""

    fragment: Int


class UploadStatusRequest(Record):
    """``UploadStatus``: the bytes the syncer holds of an upload."""

    upload: UploadId


class PushRequest(Record):
    """``Push`` (the commit of a push): its uploaded slices, fragment, tokens claimed, base version, the round's
    seconds, the island's session, and (a shard other than the coordinator) the coordinator's grant."""

    slices: Annotated[tuple[UploadId, ...], Field(min_length=1, max_length=MAX_SLICES)]
    fragment: Int
    tokens: Int
    base_version: Int
    session: Int
    round_s: Seconds | None = None
    grant: Grant | None = None


class UploadHeader(Record):
    """``Upload``'s first message: the upload's id, the offset its bytes continue at, its fragment, the slice's
    ranges, and the payload's size in bytes; ``commit`` (the leader's slice): the push to commit once the
    syncer holds this upload and every other one its ``slices`` name, answered in the reply (the commit rides
    on the upload: no ``Push`` call's round trip after the last byte)."""

    upload: UploadId
    fragment: Int
    ranges: Ranges
    size: Int
    offset: Int = 0
    commit: PushRequest | None = None


class LeaveRequest(Record):
    """``Leave``: the island's counters, and ``used``, the steps of its session it took."""

    used: Int | None = None
    steps: Int | None = None
    compute_s: Figure | None = None
    bytes_sent: Figure | None = None
    bytes_received: Figure | None = None
    last_loss: Reported = None
    codec_s: Figure | None = None
    resets: Int | None = None
    skipped_steps: Int | None = None
    session: Session = None




class DownloadRequest(Record):
    """``Download``: a fragment's values at ``ranges`` (None: all of it), from ``offset`` of ``version``'s bytes.
    With a ``pull_codec`` other than fp32: ``have``, the version the island holds (None: none, it starts or
    rejoins: the full fragment), and ``since``, the header's ``since`` of the bytes already held; ``epoch``: the
    header's ``epoch`` of the bytes already held (a resumption continues only in the same answer: version, since
    and epoch)."""

    fragment: Int
    ranges: Ranges | None = None
    version: Int | None = None
    offset: Int = 0
    have: Int | None = None
    since: Int | None = None
    epoch: Int | None = None


# --- replies ------------------------------------------------------------------------------------------------
class JoinReply(Record):
    versions: Ints
    steps: Int
    session: Int
    grant: Grant | None = None


class HelloReply(Record):
    shard: Int
    fragments: Ints


class ReserveStepsReply(Record):
    granted: Int
    wait: bool = False
    grant: Grant | None = None


class BufferedReply(Record):
    """``Buffered``'s: the fragments whose buffer holds the island's push; ``realign`` (only from a syncer with
    ``realign_pushes``, when the asked ``fragment``'s push has left the buffer: merged): the share of a round its
    merge arrived behind the fragment's previous, larger merge (:data:`Share`; said once)."""

    buffered: Ints
    realign: Share | None = None


class HeartbeatReply(Record):
    spent: bool


class VersionReply(Record):
    version: Int




class PushReply(Record):
    """``Push``'s: accepted, answered (merged or refused now; else it waits in the buffer: ``Buffered``), the
    version to pull; ``realign`` (only from a syncer with ``realign_pushes``, a push merged now): as
    :class:`BufferedReply`'s."""

    accepted: bool
    answered: bool
    version: Int | None = None
    realign: Share | None = None


class ReceivedReply(Record):
    """``UploadStatus``'s and ``Upload``'s: the bytes the syncer holds of the upload; ``push`` (an upload that
    carried a ``commit``): the commit's answer, as ``Push``'s; None when the other slices did not arrive while
    this one waited (the island commits with ``Push``)."""

    received: Int
    push: PushReply | None = None


class LeaveReply(Record):
    ok: bool
    returned: Int
    grant: Grant | None = None


class FinishReply(Record):
    """A shard's part of the run's summary (its syncer's statistics as :meth:`Syncer.stats` gives them)."""

    shard: Int
    fragments: Ints
    versions: Ints
    numel: Int
    stats: dict[str, Any]
    merged_tokens: float
    restarts: Int
    refused_calls: dict[str, Int]


class OkReply(Record):
    ok: bool


class DownloadHeader(Record):
    """``Download``'s first message: the version served, its bytes, and the offset they are sent from;
    ``since``: the bytes are the pull codec's payloads of the versions ``since + 1 .. version`` (None: float32
    values); ``epoch``: the syncer's restarts from its checkpoint (a syncer killed after answering a commit and
    before writing it numbers the next version as the lost one was: the same version of another epoch is other
    bytes)."""

    version: Int
    size: Int
    offset: Int
    since: Int | None = None
    epoch: Int | None = None


#: each method's request record (``Upload``: its header)
REQUESTS: dict[str, type[Record]] = {
    "Join": JoinRequest, "Hello": HelloRequest, "ReserveSteps": ReserveStepsRequest, "Buffered": BufferedRequest,
    "Heartbeat": HeartbeatRequest, "UploadStatus": UploadStatusRequest, "Push": PushRequest,
    "PullMeta": FragmentRequest, "Leave": LeaveRequest, "Finish": Empty, "Close": Empty, "Upload": UploadHeader,
    "Download": DownloadRequest}
#: each method's reply record (``Download``: its header)
REPLIES: dict[str, type[Record]] = {
    "Join": JoinReply, "Hello": HelloReply, "ReserveSteps": ReserveStepsReply, "Buffered": BufferedReply,
    "Heartbeat": HeartbeatReply, "UploadStatus": ReceivedReply, "Push": PushReply, "PullMeta": VersionReply,
    "Leave": LeaveReply, "Finish": FinishReply, "Close": OkReply, "Upload": ReceivedReply,
    "Download": DownloadHeader}

R = TypeVar("R", bound=Record)


class SchemaError(ValueError):
    """A message that is not its method's record: one line naming the field and what it must be."""


def parse(model: type[R], data: bytes) -> R:
    """The record ``model`` of a message's JSON bytes: nesting depth checked first, then every field.

    Raises:
        SchemaError: too deep, not JSON, or not ``model`` (the first field at fault, one line).
    """
    try:
        wire.check_depth(data)
        return model.model_validate_json(data, strict=True)
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        field = ".".join(str(x) for x in first["loc"]) or "message"
        raise SchemaError(f"{field}: {first['msg']}"[:200]) from None
    except ValueError as e:  # too deep
        raise SchemaError(str(e)[:200]) from None


def encode(record: Record) -> bytes:
    """A record as the JSON of the wire (:func:`~atoll.runtime.service.wire.dumps`): the fields set when it was
    made (an optional field left out stays out), NaN and infinities as JSON's ``NaN`` / ``Infinity``."""
    return wire.dumps(record.model_dump(exclude_unset=True))
