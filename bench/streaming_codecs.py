"""Launcher: ``python bench/streaming_codecs.py [flags]``. The benchmark and its docstring: atoll/bench/streaming_codecs.py."""
from atoll.bench.streaming_codecs import main

if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
