"""The `pdserve` command: one entry point for every part of a pdserve cluster.

Each subcommand lives in the package that owns it and is imported only when used, so
`pdserve router` never pulls in torch.
"""
