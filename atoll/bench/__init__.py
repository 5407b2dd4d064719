"""Benchmarks, apart from the library. Results go to ``bench/out/<name>/`` (``results.json``, ``results.md``).

Launch them with ``atoll bench suite`` (:mod:`~atoll.bench.suite`: every strategy at equal tokens),
``atoll bench wan`` (:mod:`~atoll.bench.wan`: real shaped links in network namespaces, as root), or the
launchers under the repository's ``bench/`` folder, ``python bench/<name>.py``, whose bodies live here:
:mod:`~atoll.bench.diloco_vs_ddp`, :mod:`~atoll.bench.streaming_codecs`, :mod:`~atoll.bench.demo_sweep`,
:mod:`~atoll.bench.decoupled`, :mod:`~atoll.bench.overhead`, :mod:`~atoll.bench.same_numbers` (and ``wan``).

What they share (one run cache, one results writer, the common flags): :mod:`~atoll.bench.common`. The
emulated WAN: :mod:`~atoll.bench.netns` (namespaces, veth, bridge, tc tbf: :class:`~atoll.bench.netns.EmulatedWan`)
on :mod:`~atoll.bench.namespaces` (``ip``/``tc``, entering a namespace), :mod:`~atoll.bench.delay` (the TUN
delay forwarder) and :mod:`~atoll.bench.counters` (interface counters over time); the WAN benchmark's
measurements and report: :mod:`~atoll.bench.wan_report`.
"""
