"""Launcher: ``python bench/overhead.py [flags]``. The benchmark and its docstring: atoll/bench/overhead.py."""
from atoll.bench.overhead import main

if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
