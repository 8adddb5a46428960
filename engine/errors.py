"""Errors the engine raises for bad input or bad configuration, each naming its cause."""

from pdserve.api.errors import InvalidRequestError
from pdserve.config.fields import ConfigError  # one type for settings and engine checks

__all__ = ["ConfigError", "InvalidRequestError"]
