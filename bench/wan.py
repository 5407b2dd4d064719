"""Launcher: ``python bench/wan.py [flags]`` (the same as ``atoll bench wan``). The benchmark and its docstring:
atoll/benchmarks/wan.py."""
from atoll.benchmarks.wan import main

if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
