"""The decode role: admit PD requests only when the whole prompt fits, hold blocks for the
part the local prefix cache lacks, order the prefill from a prefill node, import its KV
through the connector, then decode the request in the continuous batch. Every state has
a deadline; on failure the request is prefilled locally or ends with a clear error, and
its blocks are freed once no late write can reach them.
"""
