"""Launcher: ``python bench/wan.py [flags]``. The benchmark and its docstring: atoll/bench/wan.py."""
from atoll.bench.wan import main

if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
