"""Errors the engine raises for bad input or bad configuration, each naming its cause."""

from pdserve.api.errors import InvalidRequestError

__all__ = ["ConfigError", "InvalidRequestError"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
