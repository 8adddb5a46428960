"""A node's OpenAI-compatible HTTP server: protocol models, FastAPI app, Prometheus metrics.

`build_app(config, addresses)` returns a FastAPI app whose lifespan starts an `AsyncLLM`
(and with it the EngineCore process) and stops it on shutdown; `engine.cli serve` runs it.
"""
