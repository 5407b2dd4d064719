"""The ``atoll`` command.

    atoll train [--config run.toml] [--strategy diloco] [--islands 4] [--sync-every 50] ...
    atoll train --resume RUN_DIR [--steps 1200]
    atoll prepare --data DIR [--tokenizer FOLDER] [--islands 4] ...   # read, tokenize and cache a corpus once
    atoll train --runtime collective --islands 2 --ranks-per-island 2    # real processes, this machine
    torchrun --nproc-per-node 4 -m atoll.cli train --runtime collective --islands 2 --ranks-per-island 2
    atoll sweep --outer-lr 0.5,0.7,1 --sync-every 25,50 --at-mbps 100 [--out DIR]   # a grid, compared
    atoll report RUN_DIR [RUN_DIR ...] [--names A,B] [--out report.png]
    atoll bench wan [--steps 600] [--bandwidths 10,100] [--sync-every 100,200] ...   # as root
    atoll bench suite [--quick] [--steps 800] [--out bench/out/suite]   # every strategy, one report
    atoll syncer --listen 0.0.0.0:7070 --tls-cert C --tls-key K --credentials DIR --out DIR [run flags]
    atoll island --syncer HOST:7070 --tls-ca C --island 0 --credential DIR/island_0.token [run flags]
    atoll project --table                     # projection to 1B/12B/100B models (no training)
    atoll project --paper-scale               # decoupled at 12B over 2-5 Gbit/s, with the measured link shares
    atoll project --params 12e9 --step-compute-s 6 --bandwidth-mbps 2000 [--islands 4] ...

Every field of :class:`atoll.config.TrainConfig` is a flag of ``atoll train`` (``sync_every`` ->
``--sync-every``); ``atoll train --help`` lists them with their documentation. Bad input prints one line,
``atoll: error: <field>: <what is wrong>; <fix>``, and exits with status 2. A collective run whose rank
failed exits with that rank's status (3: another island stopped responding; 128 + N: killed by signal N).
SIGINT (Ctrl-C) or SIGTERM makes ``atoll train`` finish the inner step in progress, write a checkpoint of
it and exit with 128 + N (130, 143; a second signal: at once, same status; :mod:`atoll.job.stop`).
A run that diverged (docs/reliability.md, "Bad numbers") writes its summary, prints one line
``atoll: error: training diverged at step N: <what>; <fix>`` and exits with status 1.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any, NoReturn

from atoll.errors import AtollError, Interrupted, PeerWriteError, RunFailed, disk_error_line


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors and exit status 2; a flag is never taken for a prefix of another
    (``--step`` is not ``--steps``: a script must not change meaning when a flag is added)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"atoll: error: {message}; see '{self.prog} --help'\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        """As argparse, but unknown flags are reported by the subcommand they were given to, with the
        closest flag of that subcommand (``--sync-evry``: did you mean --sync-every?)."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            sub = self._subcommand(parsed)
            flag = next((a.split("=")[0] for a in extra if a.startswith("--")), "")
            close = difflib.get_close_matches(flag, sub._option_string_actions, n=1) if flag else []
            hint = f" (did you mean {close[0]}?)" if close else ""
            sub.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
        return parsed

    def _subcommand(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The deepest subcommand parser ``parsed`` went through (this parser if none)."""
        parser: argparse.ArgumentParser = self
        for action in parser._subparsers._group_actions if parser._subparsers else []:
            name = getattr(parsed, action.dest, None)
            if isinstance(action, argparse._SubParsersAction) and name in action.choices:
                sub = action.choices[name]
                return sub._subcommand(parsed) if isinstance(sub, _Parser) else sub
        return parser


def _metavar(annotation: Any) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(annotation)) + "}"
    if args and typing.get_origin(args[0]) is typing.Literal:
        return _metavar(args[0])
    base = args[0] if args else annotation
    return {int: "N", float: "X", str: "TEXT", Path: "PATH"}.get(base, "VALUE")


def add_config_flags(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per setting (:func:`atoll.config.applies.catalog`: the run's, the shared sections',
    each strategy's and runtime's own), documented from the field's description, with the strategies' own
    defaults for it where they differ (:func:`atoll.config.applies.strategy_defaults`)."""
    from atoll.config.applies import catalog, strategy_defaults

    group = parser.add_argument_group("run settings (each also a key of the TOML file)")
    for name, field in catalog().items():
        if name in exclude:
            continue
        flag = "--" + name.replace("_", "-")
        default = field.get_default(call_default_factory=True)  # a list field's factory: [] (none), not a sentinel
        own = "; ".join(f"{s}: {d}" for s, d in strategy_defaults(name).items())
        help_text = f"{field.description} [default: {default}{'; ' + own if own else ''}]"
        if field.annotation is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument(flag, dest=name, metavar=_metavar(field.annotation), default=argparse.SUPPRESS,
                               help=help_text)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("atoll")
    except PackageNotFoundError:  # run from a checkout without installing it
        return "(not installed)"


def build_parser(train_flags: bool = True) -> argparse.ArgumentParser:
    """The ``atoll`` command's parser; ``train_flags=False`` leaves out the run settings of ``atoll train``
    (they need the whole config, and with it every strategy and torch: other commands start faster)."""
    parser = _Parser(prog="atoll", description="Train language models across islands of compute joined by slow links.")
    parser.add_argument("--version", action="version", version=f"atoll {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p_train = sub.add_parser("train", help="train a model (default: diloco, 4 islands, nano model, stdlib corpus)",
                             description="Train a model across islands. Settings: defaults < --config TOML < flags.")
    p_train.add_argument("--config", type=Path, default=None, metavar="PATH", help="a TOML file of run settings")
    p_train.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                         help="continue the run in RUN_DIR from its latest checkpoint (flags given override "
                         "its saved settings, e.g. --steps to train longer)")
    if train_flags:
        add_config_flags(p_train)

    p_prepare = sub.add_parser("prepare", help="read, tokenize and cache a corpus as 'atoll train' with the same "
                               "flags would, without training (a large corpus prepared once)",
                               description="Prepare the data of a run (tokenizer, token cache, island shards) and "
                               "say what it holds; a later 'atoll train' with the same data flags reads the cache.")
    p_prepare.add_argument("--config", type=Path, default=None, metavar="PATH", help="a TOML file of run settings")
    if train_flags:
        add_config_flags(p_prepare)

    p_sweep = sub.add_parser("sweep", help="a grid of runs (any train flag as a comma-separated list), compared at "
                             "equal tokens and at equal wall time on a link", description=_sweep_doc())
    p_sweep.add_argument("--config", type=Path, default=None, metavar="PATH", help="a TOML file of run settings")
    p_sweep.add_argument("--out", type=Path, default=None, metavar="DIR",
                         help="the sweep's folder: one run folder per point, results.json, results.md, sweep.png "
                         "[default: runs/sweep-<time>]")
    from atoll.benchmarks import sweep

    sweep.add_arguments(p_sweep)
    if train_flags:
        add_config_flags(p_sweep, exclude=("out",))

    p_report = sub.add_parser("report", help="plot held-out and training loss of one or several runs side by side",
                              description="Plot held-out loss (markers) and training loss (thin lines) of atoll runs "
                              "against training tokens, simulated wall time and bytes sent per island; each run is "
                              "labelled by its strategy and the settings in which the runs differ.")
    p_report.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR",
                          help="the folder of an atoll run (its --out: metrics.jsonl, config.json, summary.json), "
                          "finished or not")
    p_report.add_argument("--out", type=Path, default=None, metavar="PNG",
                          help="PNG to write [default: RUN_DIR/report.png for one run, else report.png in the "
                          "folder that holds the runs]")
    p_report.add_argument("--names", default=None, metavar="NAME[,NAME...]",
                          help="legend labels, one per RUN_DIR, comma-separated [default: what differs between "
                          "the runs]")

    from atoll.runtime.service import commands

    commands.add_parsers(sub, add_config_flags if train_flags else None)

    from atoll.analysis import paper_scale, projection
    from atoll.benchmarks import suite, wan, wan_decoupled  # no torch at import: the parser stays fast

    p_project = sub.add_parser("project", help="project step time, utilization, bytes and goodput of each "
                               "strategy to real scale (arithmetic, no training)",
                               description=_plain(projection.__doc__))
    projection.add_arguments(p_project)
    paper_scale.add_arguments(p_project)

    p_bench = sub.add_parser("bench", help="run a benchmark: suite (every strategy and codec, one report), "
                             "wan (ddp vs diloco over emulated links, as root) or wan-decoupled (the syncer and "
                             "island jobs over emulated links, as root)",
                             description="Benchmarks. 'atoll bench suite' (every strategy and the main codecs on "
                             "the default benchmark at equal tokens, re-timed at 10 Mbit/s to 10 Gbit/s; "
                             "results.json, results.md, plots; its --out defaults to the committed "
                             "bench/out/suite, whose finished runs it reuses: pass --out DIR for your own); "
                             "'atoll bench wan' (real shaped links, root); 'atoll bench wan-decoupled' (the "
                             "syncer and 3 island jobs over shaped links, TLS, against synchronous diloco and "
                             "ddp, root).")
    benches = p_bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    p_suite = benches.add_parser("suite", help="every strategy and the main codecs at equal tokens; one "
                                 "table and plots, re-timed at 10 Mbit/s, 100 Mbit/s, 1 and 10 Gbit/s",
                                 description=_plain(suite.__doc__))
    suite.add_arguments(p_suite)
    p_wan = benches.add_parser("wan", help="ddp vs diloco, collective runtime, each island in a network "
                               "namespace behind tc-shaped links (needs root)",
                               description=_plain(wan.__doc__) + " Needs root; skips (status 0) "
                               "without it.")
    wan.add_arguments(p_wan)
    wan_decoupled.add_parser(benches, _plain)
    return parser


def _cmd_train(args: argparse.Namespace) -> int:
    from atoll.config import build_config, load_run_config
    from atoll.config.applies import catalog

    overrides = {k: v for k, v in vars(args).items() if k in catalog()}
    refusal = _runtime_refusal(overrides.get("runtime"))
    if refusal is not None:  # (before the strategy's check, whose advice would not run under atoll train)
        raise AtollError(refusal)
    if args.resume is not None:
        if args.config is not None:
            raise AtollError("config: --config cannot be combined with --resume; pass flags to override settings")
        config = load_run_config(args.resume, overrides)
        if _finished(args.resume, config.steps):  # not its table again, as if it had trained; nothing written
            if os.environ.get("RANK", "0") == "0":
                print(f"atoll: resume: {args.resume} already finished its {config.steps} steps; nothing to train "
                      f"(pass --steps N with N > {config.steps} to train further)", file=sys.stderr)
            return 0
    else:
        config = build_config(args.config, overrides)
    # heavy imports (torch, transformers) only once the settings are known to be valid
    from rich.console import Console

    from atoll.job.metrics import summary_table

    if config.runtime == "collective" and not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        from atoll.runtime.collective import launch  # start the ranks on this machine; no model here

        summary = launch(config, "atoll.training:train", resume=args.resume is not None)
    else:
        from atoll.training import train

        summary = train(config, resume=args.resume is not None)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
        Console().print(summary_table(summary))
        plots = "report.png, timeline.png" if (Path(summary["out"]) / "timeline.png").is_file() else "report.png"
        print(f"run folder: {summary['out']} (summary.json, metrics.jsonl, {plots}, checkpoints/)")
    if summary.get("diverged"):  # the run stopped: not a result (exit status 1); summary.json says where
        from atoll.job.divergence import message

        if os.environ.get("RANK", "0") == "0":
            print(f"atoll: error: {message(summary['diverged'])}", file=sys.stderr)
        return 1
    if summary.get("starved"):  # an island's pushes were all refused: the model did not train on its work
        print(f"atoll: error: {summary['starved']}", file=sys.stderr)
        return 1
    if summary.get("gave_up"):  # the failure trace left no time to train: not a result (exit status 1)
        print(f"atoll: error: chaos: the run stopped early with {summary.get('tokens', 0):,} tokens trained (see the "
              "warning above); raise MTBF_S or lower DOWNTIME_S", file=sys.stderr)
        return 1
    if config.runtime == "collective" and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from atoll.runtime.process_end import end_process

        end_process(0)  # a rank under torchrun, its run finished: no teardown that could abort it (SIGABRT)
    return 0


def _runtime_refusal(runtime: str | None) -> str | None:
    """The one line ``atoll train`` answers ``--runtime NAME`` with where that runtime is run by other commands
    (``service``: ``atoll syncer`` and ``atoll island``); None for any other (an unknown name: the config's
    error names it)."""
    from atoll.runtime.registry import names, spec

    return spec(runtime).refusal if runtime in names() else None


def _finished(run_dir: Path, steps: int) -> bool:
    """Whether the run in ``run_dir`` trained all its ``steps``: its ``summary.json`` and its latest checkpoint
    are of that step (a run killed between the two, or that diverged, resumes as before)."""
    import json

    from atoll.job.checkpoint import latest_step

    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        step = latest_step(run_dir)
    except (OSError, UnicodeDecodeError, ValueError, AtollError):
        return False
    return isinstance(summary, dict) and summary.get("steps") == steps == step \
        and not summary.get("diverged") and not summary.get("gave_up")


def _cmd_prepare(args: argparse.Namespace) -> int:
    import time

    from atoll.config import build_config
    from atoll.config.applies import catalog
    from atoll.job.data import default_cache_dir, prepare_data
    from atoll.job.data.pretrained import tokenizer_source

    config = build_config(args.config, {k: v for k, v in vars(args).items() if k in catalog()})
    cache_dir = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
    t0 = time.perf_counter()
    source = tokenizer_source(config.model, config.tokenizer)
    data = prepare_data(config.data, config.islands, config.vocab_size, config.seed, cache_dir,
                        partition=config.partition, text_field=config.text_field, tokenizer=source,
                        max_documents=config.max_documents)
    tokenizer = (f"'{source}'" if source
                 else "atoll's BPE, cached" if data.tokenizer_from_cache else "atoll's BPE, trained")
    print(f"{config.data}: {data.num_documents:,} documents ({data.num_val_documents:,} held out), "
          f"{data.num_train_tokens:,} training and {data.num_val_tokens:,} validation tokens for {config.islands} "
          f"islands; {data.vocab_size:,}-token vocabulary ({tokenizer}); tokens "
          f"{'from the cache' if data.tokens_from_cache else 'tokenized'} in {time.perf_counter() - t0:.1f} s; "
          f"cache: {cache_dir}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from atoll.errors import ConfigError
    from atoll.job.report import check_runs, default_out, plot_runs

    check_runs(args.runs)  # a path that is not a run is what is wrong, not the report.png beside it
    out = args.out if args.out is not None else default_out(args.runs)
    if out.is_dir() or (out.parent.exists() and not out.parent.is_dir()):
        raise ConfigError(f"out: '{out}' is a folder or lies under a file; pass a PNG path with --out")
    if not out.parent.is_dir():  # a mistyped folder is not made: bad input writes nothing
        raise ConfigError(f"out: the folder '{out.parent}' does not exist; make it first (mkdir -p '{out.parent}') "
                          "or pass --out in an existing folder")
    names = [n.strip() for n in args.names.split(",")] if args.names is not None else None
    try:
        path = plot_runs(args.runs, out, labels=names)
    except OSError as e:
        raise ConfigError(f"out: cannot write '{out}' ({e.strerror or e}); pass another --out") from None
    print(f"wrote {path}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "suite":
        from atoll.benchmarks.suite import run_suite

        return run_suite(args)
    from atoll.benchmarks import wan, wan_decoupled

    return (wan_decoupled if args.bench == "wan-decoupled" else wan).run_benchmark(args)


def _sweep_doc() -> str:
    from atoll.benchmarks import sweep

    return _plain(sweep.__doc__)


def _plain(doc: str | None) -> str:
    """A module docstring's first paragraph as ``--help`` text: reST markup (````x````, ``:func:`~a.b```)
    as the plain words it marks."""
    text = (doc or "").split("\n\n")[0]
    text = re.sub(r":[a-z]+:`~?(?:[\w.]+\.)?([^`]+)`", r"\1", text)
    return text.replace("``", "")


def _cmd_sweep(args: argparse.Namespace) -> int:
    import time

    from atoll.benchmarks.sweep import run_sweep
    from atoll.config import build_config
    from atoll.config.applies import catalog

    values = {k: v for k, v in vars(args).items() if k in catalog() and k != "out"}
    if args.config is not None:  # the file's settings, then the flags (whose lists are swept)
        values = {**build_config(args.config).model_dump(exclude_defaults=True, mode="json"), **values}
    out = args.out or Path("runs") / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    return run_sweep(args, values, out)


def _cmd_project(args: argparse.Namespace) -> int:
    if args.paper_scale:
        from atoll.analysis.paper_scale import run_cli as paper_scale

        print(paper_scale(args))
        return 0
    from atoll.analysis.projection import run_cli

    print(run_cli(args))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``atoll`` command; returns the exit status (2 for bad input)."""
    words = sys.argv[1:] if argv is None else argv
    train_flags = words[:1] in (["train"], ["sweep"], ["prepare"], ["syncer"], ["island"]) or not words
    args = build_parser(train_flags=train_flags).parse_args(argv)
    try:
        from atoll.job.divergence import install_fault_hook_from_env

        install_fault_hook_from_env()  # a test's child process: its faults, once, before any training step
        if args.command == "train":
            return _cmd_train(args)
        if args.command == "sweep":
            return _cmd_sweep(args)
        if args.command == "prepare":
            return _cmd_prepare(args)
        if args.command == "report":
            return _cmd_report(args)
        if args.command in ("syncer", "island"):
            from atoll.runtime.service import commands

            return commands.run(args)
        if args.command == "bench":
            return _cmd_bench(args)
        if args.command == "project":
            return _cmd_project(args)
    except AtollError as e:
        print(f"atoll: error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:  # a rank of a collective run failed: one line (or the rank printed it)
        if str(e):
            print(f"atoll: error: {e}", file=sys.stderr)
        return e.exit_code
    except Interrupted as e:  # SIGINT/SIGTERM: the run wrote a checkpoint of the step it reached
        if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
            again = ("; or run the command again (finished runs are reused)"
                     if args.command in ("sweep", "bench") else "")
            print(f"atoll: {e}{again}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"atoll: interrupted; {_resume_hint(args)}", file=sys.stderr)
        return 130
    except OSError as e:  # the disk filled up, a folder became read-only: checkpoints are atomic, none is torn
        if not isinstance(e, PeerWriteError):  # (under torchrun: another rank said it)
            print(disk_error_line(e, _resume_hint(args)), file=sys.stderr)
        return 1
    except (MemoryError, RuntimeError) as e:
        message = str(e).lower()  # (CUDA: "out of memory"; torch's CPU allocator: "can't allocate memory")
        if not isinstance(e, MemoryError) and "out of memory" not in message and "can't allocate memory" not in message:
            raise
        print("atoll: error: out of memory; lower --batch-size, --islands or --model, or use --precision bf16, "
              f"then {_resume_hint(args)}", file=sys.stderr)
        return 1
    return 0


def _resume_hint(args: argparse.Namespace) -> str:
    """What an interrupted command can do next: resume the run it trained, naming its folder."""
    from atoll.job import checkpoint

    run = Path(args.resume) if getattr(args, "resume", None) else checkpoint.last_run_dir
    if args.command == "syncer":  # its restart rule (docs/deployment.md): the same command continues its run
        return "run the same atoll syncer command again (it continues its run)"
    if args.command != "train" or run is None:
        return "run the command again (finished runs are reused)" if args.command in ("sweep", "bench") else \
            "nothing to resume"
    return checkpoint.resume_advice(run)


if __name__ == "__main__":
    sys.exit(main())
