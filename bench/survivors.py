"""Launcher: ``python bench/survivors.py [flags]``. The benchmark and its docstring: atoll/bench/survivors.py."""
from atoll.bench.survivors import main

if __name__ == "__main__":
    raise SystemExit(main())
