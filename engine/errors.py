"""Errors that name what was wrong with a request; any layer raises them, the router maps
them to INVALID_ARGUMENT / HTTP 400 (`engine.sampling` re-exports it, where it began)."""

from __future__ import annotations

__all__ = ["InvalidParameterError"]


class InvalidParameterError(ValueError):
    """Bad user input; `field` names the offending parameter (mapped to INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type[InvalidParameterError], tuple[str, str]]:
        # Raised in a worker, it crosses Ray pickled; the default reduce would call
        # __init__ with the one formatted string and fail to rebuild it there.
        return (type(self), (self.field, self.message))
