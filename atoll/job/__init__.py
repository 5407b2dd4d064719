"""The job around the strategies: data, model, islands, evaluation, checkpoints, metrics, summary and report.

:class:`atoll.job.run.Run` owns a run's bookkeeping once for every driver (the lockstep loop, the
decoupled event simulation, the Ray driver, every rank of the collective runtime).
"""
