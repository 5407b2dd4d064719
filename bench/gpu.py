"""Launcher: ``python bench/gpu.py [flags]``. The benchmark and its docstring: atoll/bench/gpu.py."""
from atoll.bench.gpu import main

if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
