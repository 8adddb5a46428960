"""Errors for bad client input, shared by the engine, the node and the router."""


class InvalidRequestError(ValueError):
    """A request cannot be served as given (bad sampling parameter, bad prompt).

    `param` names the offending field; HTTP servers turn this into a 400 with an
    OpenAI-style error body.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
