"""Launcher: ``python bench/diloco_vs_ddp.py [flags]``. The benchmark and its docstring: atoll/bench/diloco_vs_ddp.py."""
from atoll.bench.diloco_vs_ddp import main

if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
