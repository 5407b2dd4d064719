"""Codec throughput on one CPU thread against the links it feeds: can the codec keep up with the wire?

    python bench/codec_speed.py                              # 1e8 float32 values, every codec, 5 repeats
    python bench/codec_speed.py --numel 1e7 --codecs int4,int8 --repeats 3 --out /tmp/codec_speed

For each codec (:mod:`atoll.algorithms.codecs`, block 64, nearest rounding; ``topk`` keeps 1%) the flat
float32 tensor of ``--numel`` normal values is encoded and packed into one byte buffer (what a transport
sends: :meth:`~atoll.algorithms.codec_base.Encoded.pack`), then unpacked and decoded, with
``torch.set_num_threads(1)``; each side's median seconds over ``--repeats`` (after one warm-up) give its
throughput in GB/s of input (10^9 bytes of float32 values per second). Against a link of L bit/s, which moves
the payload of the tensor in ``payload_bytes * 8 / L`` seconds, the table gives the codec's seconds (encode
plus decode) per second of transfer: above 1, the codec, not the link, sets the pace of an exchange. Decode
into place (:meth:`~atoll.algorithms.codec_base.Codec.decode_into` a view of a larger tensor) is timed apart:
the syncer decodes each slice of a push so (:func:`~atoll.runtime.service.slices.assemble_payloads`). The
machine's load (``os.getloadavg``) before and after is written beside the figures: on a shared machine the
throughputs are lower bounds.

Writes ``results.json`` and ``results.md`` into ``--out`` (default ``bench/out/codec_speed`` of the repository).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from atoll.algorithms.codecs import CODEC_NAMES, make_codec
from atoll.benchmarks.common import default_out, script_error, write_results

#: link rates of the table, bit/s: 1, 10 and 100 Gbit/s
LINKS_BPS: tuple[float, ...] = (1e9, 10e9, 100e9)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=float, default=1e8, help="float32 values per tensor [1e8]")
    parser.add_argument("--codecs", default=",".join(CODEC_NAMES), help="comma-separated codecs [all]")
    parser.add_argument("--repeats", type=int, default=5, help="timed encodes and decodes per codec [5]")
    parser.add_argument("--out", type=Path, default=None, help="output folder [bench/out/codec_speed]")
    return parser.parse_args(argv)


def measure(name: str, x: torch.Tensor, repeats: int) -> dict[str, Any]:
    """One codec's median encode (encode + pack) and decode (unpack + decode) seconds over ``repeats`` on the
    1-D float32 ``x``; its payload bytes and throughputs in GB/s of input."""
    codec = make_codec(name)
    n = x.numel()
    encode_s, decode_s, into_s = [], [], []
    place = torch.empty(n + 2, dtype=torch.float32)  # the fragment a slice is decoded into (a view of it)
    for i in range(repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        buf = codec.encode(x).pack()
        t1 = time.perf_counter()
        y = codec.decode(codec.unpack(buf, n))
        t2 = time.perf_counter()
        codec.decode_into(codec.unpack(buf, n), place[1:n + 1])
        t3 = time.perf_counter()
        if i:
            encode_s.append(t1 - t0)
            decode_s.append(t2 - t1)
            into_s.append(t3 - t2)
        del buf, y
    enc, dec, into = statistics.median(encode_s), statistics.median(decode_s), statistics.median(into_s)
    gb = n * 4 / 1e9
    row: dict[str, Any] = {"codec": name, "payload_bytes": codec.payload_bytes(n),
                           "ratio": codec.payload_bytes(n) / (4 * n),
                           "encode_s": enc, "decode_s": dec, "encode_gbps": gb / enc, "decode_gbps": gb / dec,
                           "decode_into_s": into, "decode_into_gbps": gb / into,
                           "codec_gbps": gb / (enc + dec)}
    for bps in LINKS_BPS:
        row[f"per_link_s_{bps / 1e9:g}"] = (enc + dec) / (row["payload_bytes"] * 8 / bps)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/codec_speed.py [flags]``; the exit status (2: bad flags)."""
    args = parse_args(argv)
    names = [c for c in args.codecs.split(",") if c]
    unknown = [c for c in names if c not in CODEC_NAMES]
    if unknown or not names:
        return script_error("codec_speed", ValueError(f"codecs: unknown {unknown or 'none given'}; choose from "
                                                      f"{', '.join(CODEC_NAMES)}"))
    if args.numel < 1 or args.repeats < 1:
        return script_error("codec_speed", ValueError("numel and repeats: must be >= 1"))
    out = args.out or default_out("codec_speed")
    torch.set_num_threads(1)
    x = torch.randn(int(args.numel), generator=torch.Generator().manual_seed(0))
    load_before = os.getloadavg()
    rows = []
    for name in names:
        rows.append(measure(name, x, args.repeats))
        print(f"[codec_speed] {name}: encode {rows[-1]['encode_gbps']:.3f} GB/s, decode "
              f"{rows[-1]['decode_gbps']:.3f} GB/s", flush=True)
    load_after = os.getloadavg()
    machine = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": 1,
               "torch": torch.__version__, "loadavg_1m_before": load_before[0], "loadavg_1m_after": load_after[0]}
    results = {"numel": int(args.numel), "repeats": args.repeats, "machine": machine, "rows": rows}
    gb = int(args.numel) * 4 / 1e9
    columns = [("codec", "codec"), ("payload / fp32", "ratio"), ("encode GB/s", "encode_gbps"),
               ("decode GB/s", "decode_gbps"), ("decode into place GB/s", "decode_into_gbps"),
               ("encode + decode GB/s", "codec_gbps")]
    columns += [(f"codec s per s on {bps / 1e9:g} Gbit/s", f"per_link_s_{bps / 1e9:g}") for bps in LINKS_BPS]
    notes = [f"{int(args.numel):.3g} float32 values ({gb:.2g} GB), one thread, median of {args.repeats}; GB/s of "
             "input (float32 bytes); encode includes packing into one buffer, decode the unpacking.",
             "decode into place: decode_into a view of a larger float32 tensor (how the syncer decodes each slice of a "
             "push into its place in the fragment); decode returns a new tensor, which the syncer then copied into "
             "place (one more pass over the values).",
             "codec s per s on L: encode + decode seconds over the seconds L takes to move the payload; above 1 the "
             "codec, not the link, sets an exchange's pace (1, 10, 100 Gbit/s carry 0.125, 1.25, 12.5 GB/s).",
             f"machine: {machine['cpus']} CPUs, load average (1 min) {load_before[0]:.2f} before, "
             f"{load_after[0]:.2f} after; torch {torch.__version__}."]
    print(write_results(out, results, columns, rows, title="Codec throughput (`python bench/codec_speed.py`)",
                        notes=notes))
    return 0


if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())
