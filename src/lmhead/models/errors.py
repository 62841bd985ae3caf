"""The one error type of models/: a ValueError, so the CLI prints it as one line and exits with code 2."""

from __future__ import annotations


class ModelError(ValueError):
    """A model cannot be found, installed, converted or loaded; the message says what to do."""
