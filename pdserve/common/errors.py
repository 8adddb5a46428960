"""Error types shared by every layer: bad client input (`InvalidRequestError`) and bad configuration (`ConfigError`)."""


class InvalidRequestError(ValueError):
    """A request cannot be served as given (bad sampling parameter, bad prompt).

    `param` names the offending field; HTTP servers turn this into a 400 with an
    OpenAI-style error body.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
