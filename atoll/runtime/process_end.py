"""How a finished rank's process ends: its output flushed, then :func:`os._exit`, without the interpreter's teardown."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def end_process(code: int) -> NoReturn:
    """End a finished rank's process (an ``atoll island`` job's, a collective run's under torchrun) with status
    ``code`` without the interpreter's teardown.

    A rank whose work was done and said sometimes died at interpreter exit with SIGABRT ("terminate called
    without an active exception": a native thread still joinable when its owner was destroyed), so torchrun, or
    the WAN benchmark's launcher, reported a finished job as failed (exit -6) and ``--max-restarts`` could start it
    again. The threads of the libraries a rank holds (gloo's, gRPC's) can outlive Python's finalization; their
    process group and channels are closed before this point and the run's files are written and closed, so
    nothing is left to run at exit: stdout, stderr and the logging handlers are flushed, then the process ends.
    """
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
