"""Errors the engine raises for bad input or bad configuration, each naming its cause."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class InvalidRequestError(ValueError):
    """A request cannot be served as given (bad sampling parameter, bad prompt)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
