"""Launcher: ``python bench/robust_merge.py [flags]``. The benchmark and its docstring: atoll/bench/robust_merge.py."""
from atoll.bench.robust_merge import main

if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
