"""Launcher: ``python bench/codec_speed.py [flags]``. The benchmark and its docstring: atoll/bench/codec_speed.py."""
from atoll.bench.codec_speed import main

if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
