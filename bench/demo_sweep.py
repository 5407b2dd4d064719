"""Launcher: ``python bench/demo_sweep.py [flags]``. The benchmark and its docstring: atoll/bench/demo_sweep.py."""
from atoll.bench.demo_sweep import main

if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
