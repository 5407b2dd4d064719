"""The run's record: one canonical, flat record of the settings that make a run what it is, and its digest.

``atoll syncer`` and every ``atoll island`` of one run derive it from their own config (:func:`run_record`), and
the syncer refuses an island whose record differs at its join (:func:`first_difference`, :func:`mismatch`): an
island with another seed, ``sync_every``, islands, codec... would train something else and its pushes would be
merged into this run's model. The record holds every setting that changes the maths, the data or the schedule
(the run's, the strategy's: model, tokenizer and data, seed, islands, speeds, H, fragments, codec, outer
optimizer, merge rules, steps, ...) and leaves out what each process may set for itself:

- the service's own settings (:data:`~atoll.config.runtimes.NOT_OF_THE_RUN`, declared beside
  :class:`~atoll.config.runtimes.ServiceConfig`: the syncer's listen address, TLS files, credentials and shards;
  an island's syncer, index, secret, ranks, ``shard_island`` and ``slice_transfer``; TLS trust, give-up and
  deadlines);
- the host's own (:data:`HOST_SETTINGS`: the output section, the device and how it computes the same maths, and
  ``init_from``: an island starts from the syncer's global model, pulled at its join).

Each value is the canonical JSON text of the setting (sorted keys, no spaces), so the record compares and
travels as strings (:class:`~atoll.runtime.service.schema.JoinRequest` bounds it).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from atoll.config.sections import DeviceSection, ModelSection, OutputSection

#: the run's settings that are each host's own: where and how often it writes and reports (the output section),
#: which device it computes on and how (the same maths: compiled, activations recomputed), and the weights it
#: would start from (an island of the service starts from the syncer's global model)
HOST_SETTINGS: frozenset[str] = frozenset((
    *OutputSection.model_fields, "device", "compile", "activation_checkpointing", "init_from"))
assert {"device", "compile", "activation_checkpointing"} <= set(DeviceSection.model_fields)
assert "init_from" in ModelSection.model_fields


def excluded() -> frozenset[str]:
    """The settings no run's record holds: :data:`HOST_SETTINGS` and the service's own
    (:data:`~atoll.config.runtimes.NOT_OF_THE_RUN`)."""
    from atoll.config.runtimes import NOT_OF_THE_RUN

    return HOST_SETTINGS | NOT_OF_THE_RUN


def canonical(value: Any) -> str:
    """``value`` (a setting's JSON form) as canonical JSON text: sorted keys, no spaces."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)


def run_record(config: Any) -> dict[str, str]:
    """The record of a run's settings ``config`` (a :class:`~atoll.config.TrainConfig`): setting name -> its
    canonical JSON text, every setting of the run, the strategy and the runtime but those :func:`excluded`, in
    ``--help`` order."""
    drop = excluded()
    return {k: canonical(v) for k, v in config.model_dump(mode="json").items() if k not in drop}


def digest(record: dict[str, str]) -> str:
    """The SHA-256 of a record (its keys sorted), 64 hex digits: equal records, equal digests."""
    return hashlib.sha256(canonical(dict(sorted(record.items()))).encode()).hexdigest()


#: how a setting missing from one of two records reads in a refusal
UNSET = "(not set)"


def first_difference(ours: dict[str, str], theirs: dict[str, str]) -> tuple[str, str, str] | None:
    """The first setting (in ``ours``' order, then ``theirs``') whose value differs between two records:
    (name, our value, their value; :data:`UNSET` where a record lacks it), or None: equal."""
    for name in [*ours, *(k for k in theirs if k not in ours)]:
        a, b = ours.get(name, UNSET), theirs.get(name, UNSET)
        if a != b:
            return name, a, b
    return None


def shown(text: str) -> str:
    """A record's value as a refusal shows it: a JSON string without its quotes, anything else as it is."""
    try:
        value = json.loads(text)
    except ValueError:
        return text[:80]
    return value[:80] if isinstance(value, str) else text[:80]


def mismatch(island: int, ours: dict[str, str], theirs: dict[str, str]) -> str | None:
    """One line refusing island ``island`` whose record ``theirs`` differs from the syncer's ``ours`` (naming the
    first differing setting and both values), or None: the same run."""
    diff = first_difference(ours, theirs)
    if diff is None:
        return None
    name, mine, its = diff
    return (f"settings: island {island}'s {name} is {shown(its)} but the syncer's is {shown(mine)}; start every "
            "island with the syncer's run.toml")
