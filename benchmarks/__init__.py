"""Reproducible benchmarks; each writes JSON results (and PNG plots where useful)."""
