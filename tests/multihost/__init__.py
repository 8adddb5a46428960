"""Multi-host tests on one machine: each host a network namespace on one bridge (hosts.py),
and the drills that run a launched cluster across them (`pytest -m multihost`)."""
