"""Typed, validated configuration of a training run.

One pydantic model, :class:`TrainConfig`, holds every knob. It is assembled from sections
(:mod:`atoll.config.sections`) and from each strategy's own section, declared in the strategy's module and
listed by :mod:`atoll.strategies.registry`, so a new strategy brings its flags with it. Values come from
three places, later ones winning: the defaults (a strategy may give its own for shared settings), a TOML
file (``atoll train --config run.toml``), and command-line flags (``--sync-every 50``). Every field is
documented; ``atoll train --help`` prints them all. A component that needs one section asks for it:
``CodecSection.of(config)``.

A bad value raises :class:`atoll.errors.ConfigError` with one line that names the field and the fix;
the command line turns it into ``atoll: error: ...`` and exit status 2.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError, model_validator

from atoll.config.applies import unused_setting
from atoll.config.parse import format_validation_error
from atoll.config.section import Section
from atoll.config.sections import (
    CodecSection,
    CollectiveSection,
    DataSection,
    DeviceSection,
    FragmentsSection,
    InnerOptimSection,
    ModelSection,
    NetworkSection,
    OuterOptimSection,
    OutputSection,
    RaySection,
    RunSection,
)
from atoll.errors import ConfigError
from atoll.strategies.registry import specs

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: the sections of the whole config, in --help order (each strategy's own after the shared ones)
SECTIONS: tuple[type[Section], ...] = (
    RunSection, CollectiveSection, ModelSection, DeviceSection, DataSection, InnerOptimSection, OuterOptimSection,
    CodecSection, FragmentsSection, *(s.section for s in specs() if s.section is not None), RaySection, NetworkSection,
    OutputSection,
)
STRATEGY_NAMES = tuple(s.name for s in specs())


class TrainConfig(*reversed(SECTIONS)):  # type: ignore[misc]  # pydantic lists the last base's fields first
    """Every setting of one ``atoll train`` run, flat (each field is a flag and a TOML key).

    Terms follow the DiLoCo literature: an *island* is one model replica with its own data shard;
    *inner steps* are its local optimizer steps; every ``sync_every`` (H) inner steps the islands
    exchange *pseudo-gradients* and an *outer optimizer* updates the global parameters.
    """

    strategy: Literal[STRATEGY_NAMES] = RunSection.model_fields["strategy"]  # type: ignore[valid-type]

    @model_validator(mode="before")
    @classmethod
    def _strategy_defaults(cls, data: Any) -> Any:
        """A strategy's own defaults for shared settings the user left unset (its spec's ``defaults``)."""
        if isinstance(data, dict) and data.get("strategy", "diloco") in STRATEGY_NAMES:
            from atoll.strategies.registry import spec

            own = spec(data.get("strategy", "diloco")).defaults
            data = {**data, **{k: v for k, v in own.items() if data.get(k) is None}}
        return data

    @model_validator(mode="after")
    def _check_combinations(self) -> TrainConfig:
        from atoll.strategies.registry import spec

        own = spec(self.strategy)
        # a strategy's or a runtime's own settings changed under another: refused as build_config refuses a
        # setting given explicitly (atoll.config.applies.unused_setting: one check, one sentence)
        owned = [*(f for o in specs() if o.section is not None for f in o.section.model_fields.items()),
                 *RaySection.model_fields.items()]
        unused = unused_setting(self.strategy, self.runtime,
                                [name for name, field in owned if getattr(self, name) != field.default])
        if unused is not None:
            raise ValueError(unused)
        if self.runtime not in own.runtimes:
            runs = [s.name for s in specs() if self.runtime in s.runtimes]
            which = runs[0] + " strategy" if len(runs) == 1 else ", ".join(runs[:-1]) + f" and {runs[-1]} strategies"
            raise ValueError(f"runtime: {self.runtime} runs only the {which}, not {self.strategy}; add --strategy "
                             f"{runs[0]} or pass --runtime {own.runtimes[0]}")
        if self.ray_island_resources is not None:
            if len(self.ray_island_resources) not in (1, self.islands):
                raise ValueError(f"ray_island_resources: {len(self.ray_island_resources)} entries for "
                                 f"{self.islands} islands; give one per island (';'-separated) or one for all")
            for res in self.ray_island_resources:
                for name, amount in res.items():
                    if not name or name in ("CPU", "GPU", "memory", "object_store_memory"):
                        raise ValueError(f"ray_island_resources: '{name}' is not a custom resource name; use "
                                         "--ray-cpus-per-island / --ray-gpus-per-island for CPUs and GPUs")
                    if not 0 < amount < float("inf"):
                        raise ValueError(f"ray_island_resources: {name}={amount} must be a positive number")
        if self.runtime == "collective" and self.batch_size % self.ranks_per_island:
            raise ValueError(f"batch_size ({self.batch_size}) must be divisible by ranks_per_island "
                             f"({self.ranks_per_island}), each rank taking an equal share of the island's "
                             "rows; change --batch-size or --ranks-per-island")
        if self.inner_optimizer != "adamw" and own.inner_optimizer is not None:
            raise ValueError(f"inner_optimizer: the {self.strategy} strategy brings its own inner optimizer; drop "
                             f"--inner-optimizer {self.inner_optimizer}")
        if self.shard_island:
            if self.runtime != "collective":
                raise ValueError("shard_island: only the collective runtime shards islands; add --runtime "
                                 "collective or drop --shard-island")
            if self.ranks_per_island < 2:
                raise ValueError("shard_island: an island of one rank has nothing to shard; pass "
                                 "--ranks-per-island 2 or more, or drop --shard-island")
            if self.inner_optimizer == "muon":
                raise ValueError("shard_island: Muon orthogonalizes whole matrices, not shards; drop "
                                 "--inner-optimizer muon or --shard-island")
            if not own.shards:
                which = " and ".join(s.name for s in specs() if s.shards)
                raise ValueError(f"shard_island: the {self.strategy} strategy does not run on shards (only "
                                 f"{which} do); pass --strategy diloco or drop --shard-island")
        if self.min_islands > self.islands:
            raise ValueError(f"min_islands ({self.min_islands}) exceeds islands ({self.islands}); set "
                             "--min-islands to at most --islands")
        if self.max_restarts and (self.min_islands >= self.islands or self.ranks_per_island > 1):
            raise ValueError("max_restarts: a restarted island rejoins survivors that went on without it; it needs "
                             "--min-islands below --islands and --ranks-per-island 1")
        if own.validate is not None:
            own.validate(self)
        return self

    @property
    def speeds(self) -> list[float]:
        """Each island's relative speed (``island_speeds``, default all 1.0)."""
        return list(self.island_speeds) if self.island_speeds is not None else [1.0] * self.islands

    @property
    def effective_warmup_steps(self) -> int:
        """Warmup actually used: ``warmup_steps``, capped at a tenth of ``steps`` for short runs."""
        return min(self.warmup_steps, self.steps // 10)

    @property
    def evaluate_every(self) -> int:
        """Inner steps between two evaluations: ``eval_every``, or about 20 per run (``steps // 20``)."""
        return self.eval_every if self.eval_every is not None else max(1, self.steps // 20)

    @property
    def step_batch_size(self) -> int:
        """Sequences one island consumes per inner step: ``grad_accum`` micro-batches of ``batch_size``."""
        return self.grad_accum * self.batch_size

    @property
    def tokens_per_step(self) -> int:
        """Training tokens one island consumes per inner step (grad_accum x batch_size x seq_len)."""
        return self.step_batch_size * self.seq_len


def build_config(toml_path: Path | None = None, overrides: dict[str, Any] | None = None,
                 base: dict[str, Any] | None = None) -> TrainConfig:
    """Build a :class:`TrainConfig` from defaults, an optional base dict, a TOML file and overrides.

    Args:
        toml_path: a TOML file whose top-level keys are :class:`TrainConfig` fields (or a ``[train]``
            table holding them).
        overrides: field values that win over the file (typically parsed command-line flags); values
            may be strings, which pydantic converts.
        base: values applied before the file (a resumed run's saved config, a benchmark's settings shared by
            runs of several strategies); unlike the file's and the overrides', a setting of the base that the
            strategy or runtime does not read is not refused.

    Returns:
        The validated config.

    Raises:
        ConfigError: a missing or unparsable TOML file, an unknown field, an invalid value, or a setting of
            the file or the overrides that the strategy or runtime does not read
            (:mod:`atoll.config.applies`); the one-line message names the field and the fix.
    """
    values: dict[str, Any] = dict(base or {})
    given = {k for k, v in (overrides or {}).items() if v is not None}  # set by the user, not a saved run's
    from_file: dict[str, str] = {}  # given in the TOML file (and not overridden): the refusal names the file
    if toml_path is not None:
        if not Path(toml_path).is_file():  # also a folder
            raise ConfigError(f"config: file '{toml_path}' does not exist; pass an existing TOML file")
        try:
            doc = tomllib.loads(Path(toml_path).read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(f"config: '{toml_path}' is not UTF-8 text; save it as UTF-8") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config: '{toml_path}' is not valid TOML ({e}); fix the file") from None
        table = doc.get("train", doc) if isinstance(doc.get("train"), dict) or "train" not in doc else None
        if table is None:
            raise ConfigError(f"config: 'train' in '{toml_path}' must be a table ([train]); fix the file")
        if table is not doc and set(doc) - {"train"}:
            extra = ", ".join(sorted(set(doc) - {"train"}))
            raise ConfigError(f"config: '{toml_path}' has settings outside [train] ({extra}); move them into [train]")
        problem = toml_type_error(table, toml_path)
        if problem is not None:
            raise ConfigError(problem)
        values.update(table)
        from_file = {k: str(toml_path) for k, v in table.items() if v is not None and k not in given}
        given |= set(from_file)
    values.update(overrides or {})
    try:
        config = TrainConfig(**values)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
    unused = unused_setting(config.strategy, config.runtime, sorted(given), from_file)
    if unused is not None:
        raise ConfigError(unused)
    return config


def _scalar_kind(annotation: Any) -> type | None:
    """``int``, ``float`` or ``bool`` for a field of that type (or that type or None); else None."""
    import types
    import typing

    kinds = {annotation}
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = {a for a in typing.get_args(annotation) if a is not type(None)}
    kind = kinds.pop() if len(kinds) == 1 else None
    return kind if kind in (int, float, bool) else None


def toml_type_error(table: dict[str, Any], path: Path | str) -> str | None:
    """The one-line error for the first value of a TOML file whose type does not fit its number or switch
    setting, else None.

    A flag is text by nature (pydantic converts ``--lr 1e-3``), but a TOML value has a type, and a mismatch is
    a mistake the file should not hide: a string for a number or a switch (``lr = "1e-3"``, ``compile =
    "yes"``, which pydantic would read as true), a float for a whole number (``seq_len = 32.0``), a number for
    a switch or a switch for a number. A whole number is a valid float (``lr = 1``). Keys that are not
    settings, and settings of other types (text, paths, lists), are left to the validation.
    """
    for key, value in table.items():
        field = TrainConfig.model_fields.get(key)
        kind = _scalar_kind(field.annotation) if field is not None else None
        if kind is None:
            continue
        fits = isinstance(value, bool) if kind is bool else (
            type(value) is int if kind is int else type(value) in (int, float))
        if fits:
            continue
        want = {bool: "a switch (true or false)", int: "a whole number", float: "a number"}[kind]
        got = ("the string " + repr(value) if isinstance(value, str) else
               f"the switch value {str(value).lower()}" if isinstance(value, bool) else
               f"the float {value!r}" if isinstance(value, float) else f"the number {value}" if isinstance(value, int)
               else f"a TOML {type(value).__name__}")
        example = _toml_example(kind, value, field.default)
        return f"{key}: {got} in '{path}' is not {want}; write {key} = {example}" + (
            " (no quotes)" if isinstance(value, str) and not example.startswith("<") else "")
    return None


def _toml_example(kind: type, value: Any, default: Any) -> str:
    """The TOML text of ``value`` as a ``kind``, where it reads as one unambiguously; else a placeholder."""
    text = value.strip() if isinstance(value, str) else None
    if kind is bool:
        if text is not None and text.lower() in ("true", "false"):
            return text.lower()
        return "true or false"
    try:
        number = float(text) if text is not None else None if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        number = None
    if number is not None and math.isfinite(number) and (kind is float or number.is_integer()):
        if kind is int:
            return str(int(number))
        try:  # the user's own spelling where it is a TOML number ("1e-3"), else Python's ("0.001")
            if text is not None and type(tomllib.loads(f"x = {text}")["x"]) in (int, float):
                return text
        except tomllib.TOMLDecodeError:
            pass
        return repr(number)
    sample = default if isinstance(default, (int, float)) and not isinstance(default, bool) else 1
    return f"<{'a whole number' if kind is int else 'a number'}, e.g. {sample}>"


#: Settings a resumed run may change: how long it trains, how it reports and how its islands run (a
#: collective checkpoint resumes under ``local`` and back; activation checkpointing, the same maths in less
#: memory), never what it computes.
RESUMABLE_OVERRIDES = frozenset({
    "steps", "eval_every", "eval_batches", "checkpoint_every", "progress", "progress_every", "tracker",
    "threads", "cache_dir", "activation_checkpointing",
    "link_bandwidth_mbps", "link_latency_ms", "collective_timeout_s", "runtime", "ranks_per_island",
    "min_islands", "max_restarts",
})


#: Settings every ``config.json`` atoll writes holds (it writes them all; older runs lack only later fields).
SAVED_KEYS = ("strategy", "islands", "model", "data", "steps", "seed")


def load_run_config(run_dir: Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """The saved config of a run folder, with ``overrides`` applied (e.g. more ``steps``).

    Only the settings in :data:`RESUMABLE_OVERRIDES` may differ from the saved ones: the strategy, model,
    data, islands, optimizers and codec define the run, and changing them mid-run would silently train
    something else (start a new run with ``--init-from`` instead). Nothing is written here.

    Raises:
        ConfigError: the folder holds no readable ``config.json``, or one that is not a run's settings (a
            value of the wrong type or out of range, an unknown key, a missing :data:`SAVED_KEYS` entry; field
            ``resume``, naming the file), an override changes a setting that defines the run (names it), or
            ``out`` names another folder (a run resumes in its own).
    """
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"resume: '{run_dir}' is not an atoll run folder (no config.json); pass a run's --out folder")
    fix = (f"restore the run's config.json from a backup, or start a new run (--out ANOTHER_DIR; --init-from "
           f"{run_dir} starts from its latest checkpoint's weights)")
    try:
        base = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(base, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"resume: '{path}' is unreadable ({e}); {fix}") from None
    missing = [k for k in SAVED_KEYS if k not in base]
    if missing:
        raise ConfigError(f"resume: '{path}' lacks the run's {', '.join(missing)} (not the config.json atoll wrote); "
                          f"{fix}")
    try:
        saved = build_config(base={k: v for k, v in base.items() if k != "out"}, overrides={"out": str(run_dir)})
    except ConfigError as e:  # its one line says how to fix a flag; here the file is what is wrong
        raise ConfigError(f"resume: '{path}' holds a setting atoll cannot use ({str(e).split('; ')[0]}); "
                          f"{fix}") from None
    out = (overrides or {}).get("out")
    if out is not None and Path(out).resolve() != Path(run_dir).resolve():
        raise ConfigError(f"out: a resumed run stays in its folder '{run_dir}'; drop --out (to resume the run in "
                          f"'{out}', pass --resume {out})")
    overrides = {k: v for k, v in (overrides or {}).items() if k != "out"}
    config = build_config(base=saved.model_dump(), overrides={**overrides, "out": str(run_dir)})
    for name in overrides:
        if name not in RESUMABLE_OVERRIDES and getattr(config, name) != getattr(saved, name):
            raise ConfigError(
                f"{name}: cannot change on resume (the run has {getattr(saved, name)!r}); start a new run with "
                f"--init-from {run_dir} instead"
            )
    return config
