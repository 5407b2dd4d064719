"""Launcher: ``python bench/beyond.py [flags]``. The benchmark and its docstring: atoll/bench/beyond.py."""
from atoll.bench.beyond import main

if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
