"""Launcher: ``python bench/same_numbers.py [flags]``. The benchmark and its docstring: atoll/bench/same_numbers.py."""
from atoll.bench.same_numbers import main

if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
