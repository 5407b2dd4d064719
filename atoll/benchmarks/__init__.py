"""The benchmark commands, apart from the library. Results go to ``bench/out/<name>/``
(``results.json``, ``results.md``).

``atoll sweep`` (:mod:`~atoll.benchmarks.sweep`: a grid of settings), ``atoll bench suite``
(:mod:`~atoll.benchmarks.suite`: every strategy at equal tokens) and ``atoll bench wan``
(:mod:`~atoll.benchmarks.wan`: real shaped links in network namespaces, as root; also ``python bench/wan.py``).
The one-off studies behind the committed results (``python bench/<name>.py``) are not in the package: they live
in the repository's ``bench/`` folder (:mod:`bench`).

What they share (one run cache, one results writer, the common flags): :mod:`~atoll.benchmarks.common`. The
emulated WAN: :mod:`~atoll.benchmarks.netns` (namespaces, veth, bridge, tc tbf:
:class:`~atoll.benchmarks.netns.EmulatedWan`) on :mod:`~atoll.benchmarks.namespaces` (``ip``/``tc``, entering a
namespace), :mod:`~atoll.benchmarks.delay` (the TUN delay forwarder) and :mod:`~atoll.benchmarks.counters` (interface
counters over time); the WAN benchmark's measurements and report: :mod:`~atoll.benchmarks.wan_report`.
"""
