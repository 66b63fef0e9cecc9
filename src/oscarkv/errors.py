"""Exceptions that name the problem and the fix."""

from __future__ import annotations


class OscarError(Exception):
    """Base class: every error raised on bad user input derives from this."""


class ArtifactError(OscarError):
    """A rotations artifact is corrupt, of another format version, or made for another model."""


class UnsupportedModelError(OscarError):
    """The model's shape or architecture is not supported (e.g. head_dim not a power of two)."""


class CalibrationError(OscarError):
    """Calibration cannot produce a trustworthy artifact (too little text, non-finite activations)."""


class InputTooLongError(OscarError):
    """A prompt or evaluation window is longer than the model's context."""


class AssetError(OscarError):
    """A built-in model or text could not be found or fetched."""


class TokenizerError(OscarError):
    """A tokenizer does not encode text the way its model was trained to read it."""
