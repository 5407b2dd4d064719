"""Errors that the ``atoll`` command turns into a one-line message and exit status 2."""

from __future__ import annotations


class AtollError(Exception):
    """A user-facing error: bad configuration, missing data, unusable checkpoint.

    The message is one line that names the offending field (or path) and the fix.
    The command line prints ``atoll: error: <message>`` and exits with status 2.
    """


class ConfigError(AtollError, ValueError):
    """A configuration value is invalid. The message names the field and the fix."""


class DataError(AtollError, ValueError):
    """The data source cannot be read (missing path, unknown format, offline hub)."""


class CheckpointError(AtollError, RuntimeError):
    """A checkpoint is missing, incomplete or corrupt."""
