"""The prefill role: take prefill orders from decode nodes, run each prompt through the
engine (chunked prefill, own prefix cache), push every finished block into the decode
node's blocks as chunks complete, and report the first sampled token once the last block
has landed. Afterwards nothing of the request stays except its prefix-cache blocks.
"""
