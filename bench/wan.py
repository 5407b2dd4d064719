"""The emulated-WAN benchmark (issue 3): ddp vs diloco, collective runtime, namespaces and tc tbf links.

    sudo python bench/wan.py                                   # the full benchmark: hours on 2 CPU cores
    sudo python bench/wan.py --steps 50 --sync-every 20 --out /tmp/wan-smoke   # a smoke run: minutes
    sudo atoll bench wan ...                                   # the same command

2 islands of the tiny model, each in its own network namespace, links of 10 and 100 Mbit/s (tc tbf on
both ends of each veth), ddp and diloco (H=100 and H=200) on the same tokens. See :mod:`atoll.bench.wan` for what
is measured and how. Writes bench/out/wan/results.json and results.md. Not root: one line, status 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

from atoll.bench.wan import main

if __name__ == "__main__":
    sys.exit(main(default_out=Path(__file__).resolve().parent / "out" / "wan"))
