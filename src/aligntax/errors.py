"""Exceptions raised for bad input. Each carries a message meant for the user.

The command line maps them to exit codes (:mod:`aligntax.cli.options`): an :class:`AligntaxError` is a
usage error (exit 2: a bad option value, an unknown name, a bad path) unless its class says
``exit_code = 1`` (a runtime failure: a download that does not match its hash, a run that failed
while running); any other exception is a runtime failure (exit 1)."""


class AligntaxError(Exception):
    """Base class: a problem the user can fix (bad file, unknown model, mismatch)."""

    exit_code = 2


class UsageError(AligntaxError):
    """A bad command-line value found before anything is loaded or written."""


class ModelSpecError(AligntaxError):
    pass


class HashMismatchError(AligntaxError):
    exit_code = 1


class DataError(AligntaxError):
    pass


class CompatibilityError(AligntaxError):
    """An artefact (energy model, vector, adapter) was made for another model."""
