"""`pdserve bench`: the benchmarks operators run.

`bench serve` loads any OpenAI-compatible endpoint (pdserve, vLLM, SGLang) with open-loop
arrivals or a fixed concurrency and reports TTFT/TPOT/ITL/E2E, throughput, goodput and
failures, plus pdserve's per-stage TTFT breakdown; `bench kv` measures NIXL KV-block
transfers between two processes or two hosts; `bench compare` puts two runs side by side.
The serving half is light (aiohttp, numpy, tokenizers): it never imports torch.
"""
