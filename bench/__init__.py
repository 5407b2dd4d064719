"""The studies: one-off measurements behind the committed results under bench/out/ (``python bench/<name>.py``).

Not part of the installed package (the wheel ships ``atoll`` alone); importable from the repository root
(``bench.<name>``) for the tests. The user commands (``atoll sweep``, ``atoll bench suite``, ``atoll bench
wan``) and the helpers every benchmark shares live in :mod:`atoll.benchmarks`. A study that reproduces earlier
defaults reads them from ``bench/<name>.toml`` (:func:`atoll.benchmarks.common.study_settings`), checked against today's
config by tests/test_bench_settings.py.
"""
