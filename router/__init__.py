"""The cluster's front door: the same OpenAI API as a node, served by choosing nodes.

The router tokenizes each request once, computes its block-hash chain, reads which nodes
hold its prefix (Redis KV index) and how loaded they are (registry, health checks, its own
in-flight counts), picks a decode node and a prefill node by policy, forwards the token ids
with the chosen prefill node, and relays the decode node's response or SSE stream. It holds
no state Redis does not: replicas on one Redis serve the same cluster. Imports neither the
engine, torch nor the kernels (tests/test_router_imports.py checks this).
"""
