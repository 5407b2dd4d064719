"""Launcher: ``python bench/wan_decoupled.py [flags]`` (the same as ``atoll bench wan-decoupled``). The benchmark and
its docstring: atoll/benchmarks/wan_decoupled.py."""
from atoll.benchmarks.wan_decoupled import main

if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
