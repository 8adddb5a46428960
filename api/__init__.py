"""The OpenAI-compatible HTTP API that nodes and the router both serve.

Request and response models (pydantic), the OpenAI-style error body and the HTTP plumbing
every pdserve server shares (error handlers, body-size limit). A leaf package: it imports
neither the engine, torch nor the kernels, so the router stays light.
"""
