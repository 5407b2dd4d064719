"""Typed, validated configuration of a training run: the run's settings and the owned configs of its parts.

:class:`TrainConfig` holds the settings every run reads (run, model, device, data, schedule, output:
:data:`atoll.config.sections.RUN_SECTIONS`) and two owned parts: ``strategy_config``, the chosen strategy's
own config (:class:`~atoll.config.section.StrategyConfig`, declared in the strategy's module and listed in
its spec), and ``runtime_config``, the chosen runtime's (:mod:`atoll.config.runtimes`). ``strategy`` and
``runtime`` name them (the discriminators). Values come from three places, later ones winning: the defaults
(a strategy's config has its own, and its spec may give some for the run's settings), a TOML file
(``atoll train --config run.toml``), and command-line flags (``--sync-every 50``).

Flat keys stay the interface: every flag, TOML key and saved ``config.json`` names a setting by its field
name, and the one mapping to the tree is ownership (:func:`tree_path`: a run setting stays at the top, any
other goes to the strategy's or the runtime's config that has it). A setting neither owns is refused in one
sentence (:func:`atoll.config.applies.unused_setting`). In code a setting is read from its owner:
``config.strategy_config.sync_every``, ``config.runtime_config.collective_timeout_s``; there is no flat view
(a setting the chosen strategy does not own has no value in the run, not a default). ``config.json`` is written
flat, with the run's and the owners' settings. ``atoll train --help`` documents
every setting (:func:`atoll.config.applies.catalog`).

A bad value raises :class:`atoll.errors.ConfigError` with one line that names the field and the fix;
the command line turns it into ``atoll: error: ...`` and exit status 2.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator
from pydantic.main import IncEx

from atoll.config.applies import applicable, catalog, run_settings, runtime_readers, strategy_readers, unused_setting
from atoll.config.parse import fix_hint, format_validation_error
from atoll.config.runtimes import RESTARTS_NEED
from atoll.config.section import RuntimeConfig, StrategyConfig
from atoll.config.sections import (
    DataSection,
    DeviceSection,
    ModelSection,
    OutputSection,
    RunSection,
    ScheduleSection,
)
from atoll.config.toml_types import toml_type_error
from atoll.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: the tree's owned parts: the chosen strategy's config, the chosen runtime's
TREE = ("strategy_config", "runtime_config")


def tree_path(name: str, strategy: str, runtime: str) -> str | None:
    """Where flat setting ``name`` lives in the tree of a ``strategy`` run under ``runtime``: ``name`` (a
    setting of every run), ``strategy_config.name``, ``runtime_config.name``, or None (neither owns it).

    Raises:
        KeyError: no strategy of that name.
    """
    from atoll.runtime.registry import configs
    from atoll.strategies.registry import spec

    if name in run_settings():
        return name
    if name in spec(strategy).config.model_fields:
        return f"strategy_config.{name}"
    runtimes = configs()
    if runtime in runtimes and name in runtimes[runtime].model_fields:
        return f"runtime_config.{name}"
    return None


def _owned(config_type: type[Any], given: Any, flat: dict[str, Any], strategy: str, runtime: str) -> Any:
    """The owned config of ``config_type`` from its part given whole (an instance, or a table of a TOML file)
    and its flat keys, validated alone.

    Raises:
        ValueError: a value it refuses (the one-line message of its first error), or another strategy's or
            runtime's config given whole: refused in the one sentence a flat key of it gets
            (:func:`~atoll.config.applies.unused_setting`), naming first a setting that was set explicitly.
    """
    if isinstance(given, config_type) and not flat:
        return given
    values = given.model_dump() if isinstance(given, (StrategyConfig, RuntimeConfig)) else dict(given or {})
    if isinstance(given, (StrategyConfig, RuntimeConfig)) and not isinstance(given, config_type):
        foreign = [k for k in values if k not in config_type.model_fields]
        why = unused_setting(strategy, runtime, [k for k in foreign if k in given.model_fields_set] + foreign)
        if why is not None:
            raise ValueError(why)
    try:
        return config_type(**{**values, **flat})
    except ValidationError as e:
        raise ValueError(format_validation_error(e)) from None


class TrainConfig(OutputSection, ScheduleSection, DataSection, DeviceSection, ModelSection, RunSection):
    """Every setting of one ``atoll train`` run: the run's own, the chosen strategy's and runtime's configs.

    Terms follow the DiLoCo literature: an *island* is one model replica with its own data shard;
    *inner steps* are its local optimizer steps; every ``sync_every`` (H) inner steps the islands
    exchange *pseudo-gradients* and an *outer optimizer* updates the global parameters.

    Built from flat keys (``TrainConfig(strategy="diloco", sync_every=50)``) or with the owned parts given
    whole (``TrainConfig(strategy="diloco", strategy_config=DiLoCoConfig(sync_every=50))``).
    """

    strategy_config: StrategyConfig = Field(
        default_factory=StrategyConfig, description="The chosen strategy's own config (built from the flat keys "
        "it owns; its spec's config class).")
    runtime_config: RuntimeConfig = Field(
        default_factory=RuntimeConfig, description="The chosen runtime's own config (built from the flat keys it "
        "owns: atoll.config.runtimes).")

    @model_validator(mode="before")
    @classmethod
    def _route(cls, data: Any) -> Any:
        """Flat keys to the tree: a strategy's defaults for the run's settings the user left unset (its spec's
        ``defaults``), then each owned key into the strategy's or the runtime's config, which validate it; a
        setting of another strategy or runtime is refused (:func:`~atoll.config.applies.unused_setting`)."""
        from atoll.runtime.registry import configs
        from atoll.strategies.registry import names, spec

        if not isinstance(data, dict):
            return data
        strategy = data.get("strategy", RunSection.model_fields["strategy"].default)
        runtime = data.get("runtime", RunSection.model_fields["runtime"].default)
        if strategy not in names():
            known = ", ".join(repr(n) for n in names())
            raise ValueError(f"strategy: {strategy!r} is not a strategy ({known}); {fix_hint('strategy')}")
        runtimes = configs()
        if runtime not in runtimes:
            known = ", ".join(repr(n) for n in runtimes)
            raise ValueError(f"runtime: {runtime!r} is not a runtime ({known}); {fix_hint('runtime')}")
        own = spec(strategy)
        for part in TREE:  # a part given as a table (a TOML file's [strategy_config]): its keys, as flat ones
            if isinstance(data.get(part), dict):
                data = {**data[part], **{k: v for k, v in data.items() if k != part}}
        data = {**data, **{k: v for k, v in own.defaults.items() if data.get(k) is None}}
        shared, strategy_keys, runtime_keys = run_settings(), {}, {}
        runtime_type = runtimes[runtime]
        for key in [k for k in data if k not in shared and k not in TREE]:
            if key in own.config.model_fields:
                strategy_keys[key] = data.pop(key)
            elif key in runtime_type.model_fields:
                runtime_keys[key] = data.pop(key)
            elif (strategy_readers(key) or runtime_readers(key)) and data.pop(key) is not None:  # None: unset
                raise ValueError(unused_setting(strategy, runtime, [key]))
        data["strategy_config"] = _owned(own.config, data.get("strategy_config"), strategy_keys, strategy, runtime)
        data["runtime_config"] = _owned(runtime_type, data.get("runtime_config"), runtime_keys, strategy, runtime)
        return data

    def model_dump(self, *, mode: str = "python", include: IncEx | None = None, exclude: IncEx | None = None,
                   exclude_defaults: bool = False,
                   **kwargs: Any) -> dict[str, Any]:
        """The flat settings: the run's and the owned parts' (each a flag and a TOML key), in ``--help`` order;
        ``include``/``exclude``: sets of flat names (the pydantic keywords otherwise)."""
        flat = super().model_dump(mode=mode, exclude=set(TREE), exclude_defaults=exclude_defaults, **kwargs)
        for part in TREE:
            flat.update(getattr(self, part).model_dump(mode=mode, exclude_defaults=exclude_defaults, **kwargs))
        order = {name: i for i, name in enumerate(catalog())}
        keep = set(include) if include is not None else set(flat)
        keep -= set(exclude or ())
        return {k: flat[k] for k in sorted(flat, key=lambda k: order.get(k, len(order))) if k in keep}

    def model_dump_json(self, *, indent: int | None = None, include: IncEx | None = None,
                        exclude: IncEx | None = None, exclude_defaults: bool = False,
                        **kwargs: Any) -> str:
        """:meth:`model_dump` as JSON text (what ``config.json`` holds)."""
        return json.dumps(self.model_dump(mode="json", include=include, exclude=exclude,
                                          exclude_defaults=exclude_defaults, **kwargs), indent=indent)

    @model_validator(mode="after")
    def _check_combinations(self) -> TrainConfig:
        """The checks across owners (the strategy and the runtime, the run's islands and batch); each owned
        config checks its own settings alone (its validators)."""
        from atoll.runtime.registry import spec as runtime_spec
        from atoll.strategies.registry import spec, specs

        def runs_under(s: Any) -> bool:  # listed by the strategy, or a runtime that runs its kind
            return self.runtime in s.runtimes or ("lockstep" if s.lockstep else "asynchronous") in where.kinds

        own, where = spec(self.strategy), runtime_spec(self.runtime)
        if not runs_under(own):
            runs = [s.name for s in specs() if runs_under(s)]
            which = runs[0] + " strategy" if len(runs) == 1 else ", ".join(runs[:-1]) + f" and {runs[-1]} strategies"
            raise ValueError(f"runtime: {self.runtime} runs only the {which}, not {self.strategy}; add --strategy "
                             f"{runs[0]} or pass --runtime {own.runtimes[0]}")
        runtime = self.runtime_config
        resources = getattr(runtime, "ray_island_resources", None)
        if resources is not None and len(resources) not in (1, self.islands):
            raise ValueError(f"ray_island_resources: {len(resources)} entries for {self.islands} islands; give one "
                             "per island (';'-separated) or one for all")
        ranks = getattr(runtime, "ranks_per_island", 1)
        if self.batch_size % ranks:  # (collective and service: the runtimes of islands of several ranks)
            raise ValueError(f"batch_size ({self.batch_size}) must be divisible by ranks_per_island "
                             f"({ranks}), each rank taking an equal share of the island's "
                             "rows; change --batch-size or --ranks-per-island")
        if getattr(runtime, "shard_island", False):  # (its ranks: the runtime config's own check)
            if getattr(self.strategy_config, "inner_optimizer", "adamw") == "muon":
                raise ValueError("shard_island: Muon orthogonalizes whole matrices, not shards; drop "
                                 "--inner-optimizer muon or --shard-island")
            if not own.shards:
                names = [s.name for s in specs() if s.shards]
                which = ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]
                raise ValueError(f"shard_island: the {self.strategy} strategy does not run on shards (only "
                                 f"{which} do); pass --strategy diloco or drop --shard-island")
        min_islands = getattr(runtime, "min_islands", 1)
        if min_islands > self.islands:
            raise ValueError(f"min_islands ({min_islands}) exceeds islands ({self.islands}); set "
                             "--min-islands to at most --islands")
        if getattr(runtime, "max_restarts", 0) and min_islands >= self.islands:  # (its ranks: its config's check)
            raise ValueError(RESTARTS_NEED)
        if own.validate is not None:
            own.validate(self.strategy_config, self)
        return self

    @property
    def speeds(self) -> list[float]:
        """Each island's relative speed (``island_speeds``, default all 1.0)."""
        own = self.strategy_config  # (only a strategy with islands of unequal speeds owns island_speeds)
        speeds = own.island_speeds if "island_speeds" in type(own).model_fields else None
        return list(speeds) if speeds is not None else [1.0] * self.islands

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
                 base: dict[str, Any] | None = None, set_aside: Collection[str] = ()) -> TrainConfig:
    """Build a :class:`TrainConfig` from defaults, an optional base dict, a TOML file and overrides.

    Args:
        toml_path: a TOML file whose top-level keys are :class:`TrainConfig` fields (or a ``[train]``
            table holding them).
        overrides: field values that win over the file (typically parsed command-line flags); values
            may be strings, which pydantic converts.
        base: values applied before the file (a resumed run's saved config, a benchmark's settings shared by
            runs of several strategies); unlike the file's and the overrides', a setting of the base that the
            strategy or runtime does not read is not refused.
        set_aside: settings of the TOML file left out, unread (a file shared by commands that each read part of
            it: ``atoll syncer`` and ``atoll island``).

    Returns:
        The validated config.

    Raises:
        ConfigError: a missing or unparsable TOML file, an unknown field, an invalid value, or a setting of
            the file or the overrides that the strategy or runtime does not read
            (:mod:`atoll.config.applies`); the one-line message names the field and the fix.
    """
    from atoll.strategies.registry import names

    values: dict[str, Any] = dict(base or {})
    given = {k for k, v in (overrides or {}).items() if v is not None}  # set by the user, not a saved run's
    from_file: dict[str, str] = {}  # given in the TOML file (and not overridden): the refusal names the file
    if toml_path is not None:
        if Path(toml_path).is_dir():
            raise ConfigError(f"config: '{toml_path}' is a folder; pass a TOML file (see configs/)")
        if not Path(toml_path).is_file():
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
        table = {k: v for k, v in table.items() if k not in set_aside}
        values.update(table)
        from_file = {k: str(toml_path) for k, v in table.items() if v is not None and k not in given}
        given |= set(from_file)
    values.update(overrides or {})
    strategy = values.get("strategy", RunSection.model_fields["strategy"].default)
    runtime = values.get("runtime", RunSection.model_fields["runtime"].default)
    unused = unused_setting(strategy, runtime, sorted(given), from_file, values) if strategy in names() else None
    if unused is not None:  # (an unknown strategy: the validation's error names it)
        raise ConfigError(unused)
    readable = applicable(values)  # the base's settings the run does not read are left out, not refused
    try:
        return TrainConfig(**{k: v for k, v in values.items() if k in given or k in readable})
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


#: Settings a resumed run may change: how long it trains, how it reports and how its islands run (a
#: collective checkpoint resumes under ``local`` and back; activation checkpointing, the same maths in less
#: memory), never what it computes.
RESUMABLE_OVERRIDES = frozenset({
    "steps", "eval_every", "eval_batches", "checkpoint_every", "progress", "progress_every", "tracker",
    "threads", "cache_dir", "activation_checkpointing",
    "link_bandwidth_mbps", "link_latency_ms", "collective_timeout_s", "collective_link_mbps",
    "collective_link_latency_ms", "runtime", "ranks_per_island",
    "min_islands", "max_restarts", "async_checkpoint", "outer_kernel",
})


#: Settings every ``config.json`` atoll writes holds (it writes them all; older runs lack only later fields).
SAVED_KEYS = ("strategy", "islands", "model", "data", "steps", "seed")

#: Settings whose default changed after runs were written without them, per strategy: the value a run saved
#: before the setting existed trained with. A resumed run that lacks the key keeps that value, not today's
#: default (``realign_pushes`` became on by default on 2026-12-06; a decoupled run written before it kept the
#: paper's fixed schedule).
EARLIER_DEFAULTS: dict[str, dict[str, Any]] = {"decoupled": {"realign_pushes": False}}


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
    earlier = EARLIER_DEFAULTS.get(base.get("strategy"), {}) if isinstance(base.get("strategy"), str) else {}
    base = {**{k: v for k, v in earlier.items() if k not in base}, **base}  # a run from before the key: its value
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
    before = saved.model_dump()  # flat: every setting by its name

    def cannot_change(name: str) -> ConfigError:
        return ConfigError(f"{name}: cannot change on resume (the run has {before.get(name)!r}); start a new run "
                           f"with --init-from {run_dir} instead")

    # the strategy first: another strategy's checks of the saved settings would speak before this refusal
    if overrides.get("strategy") is not None and overrides["strategy"] != before["strategy"]:
        raise cannot_change("strategy")
    config = build_config(base=before, overrides={**overrides, "out": str(run_dir)})
    now = config.model_dump()
    for name in overrides:
        if name not in RESUMABLE_OVERRIDES and now.get(name) != before.get(name):
            raise cannot_change(name)
    return config
