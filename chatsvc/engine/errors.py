"""Errors the engine raises to its callers."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of the engine's own errors."""


class RequestTooLargeError(EngineError, ValueError):
    """The request can never run: longer than the model's context or the whole KV pool."""


class EngineStoppedError(EngineError, RuntimeError):
    """The engine is not running (never started, or stopped)."""
