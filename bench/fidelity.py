"""Launcher: ``python bench/fidelity.py [flags]``. The benchmark and its docstring: atoll/bench/fidelity.py."""
from atoll.bench.fidelity import main

if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
