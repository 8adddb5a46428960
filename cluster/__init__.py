"""Cluster-level process management: the embedded Redis server (and, later, the launcher
that brings a whole cluster up from one YAML file). Imports no engine or torch.
"""
