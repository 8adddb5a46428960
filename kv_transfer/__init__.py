"""KV-cache movement between pdserve nodes: the connector interface, the NIXL transport and
connector (paged blocks WRITten straight into a peer's KV tensor), the LMCache connector, and
the Redis index and registry that say which node holds which blocks.
"""
