"""Launcher: ``python bench/reference_rules.py [--report-only]``. The benchmark and its docstring: atoll/bench/reference_rules.py."""
from atoll.bench.reference_rules import main

if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
