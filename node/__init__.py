"""A pdserve node: the OpenAI HTTP frontend over an EngineCore process, and the wiring of
engine + PD role + KV connector from one config (`pdserve serve`).

`api_server` builds the FastAPI app, `openai_serving` turns OpenAI requests into engine
requests and streams, `metrics` is the Prometheus view, `roles` builds the node's prefill or
decode role with its connector, `cli` is the `pdserve serve` subcommand.
"""
