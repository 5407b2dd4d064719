"""Benchmarks, apart from the library: ``atoll bench suite`` (every strategy at equal tokens), ``atoll bench wan``
(real shaped links in network namespaces), the scripts under the repository's ``bench/`` folder, and what
they share (one run cache, one results writer: :mod:`atoll.bench.common`). Results go to ``bench/out/``.
"""
