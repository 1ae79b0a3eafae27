"""Exceptions raised for bad input. Each carries a message meant for the user."""


class AligntaxError(Exception):
    """Base class: a problem the user can fix (bad file, unknown model, mismatch)."""


class ModelSpecError(AligntaxError):
    pass


class HashMismatchError(AligntaxError):
    pass


class DataError(AligntaxError):
    pass


class CompatibilityError(AligntaxError):
    """An artefact (energy model, vector, adapter) was made for another model."""
