"""Launcher: ``python bench/decoupled.py [flags]``. The benchmark and its docstring: atoll/bench/decoupled.py."""
from atoll.bench.decoupled import main

if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
