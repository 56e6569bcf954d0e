"""Errors of the coordination layer."""

from __future__ import annotations


class CoordinationError(Exception):
    """Base of every error raised by the scheduler package."""


class RedisUnavailableError(CoordinationError):
    """Redis cannot be reached (at start-up; later outages are ridden out, not raised)."""


class SpecError(CoordinationError):
    """A job spec value is invalid."""


class SpecMismatchError(CoordinationError):
    """A process's flags disagree with the job's spec."""


class JobExistsError(CoordinationError):
    """A new job was asked for under the name of a live one."""


class JobNotFoundError(CoordinationError):
    """No job of that name is registered in Redis."""


class ConfigError(CoordinationError):
    """A command's option has a value it cannot use (the message quotes it)."""


class RankUnavailableError(CoordinationError):
    """No rank of the job came free for a worker within its wait."""
