"""The trainer's user-facing error: one line saying why the run cannot start or continue."""


class TrainingError(Exception):
    """A one-line, user-facing reason the run cannot start or continue."""
