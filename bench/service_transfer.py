"""Launcher: ``python bench/service_transfer.py [flags]``. The benchmark and its docstring: atoll/bench/service_transfer.py."""
from atoll.bench.service_transfer import main

if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
