"""The offline API: `LLM(model=...).generate(prompts, params)` and `LLM.chat(messages)`."""

from __future__ import annotations

import itertools

from tqdm import tqdm

from pdserve.common.errors import InvalidRequestError
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.outputs import OutputStream, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import apply_chat_template, load_tokenizer


class LLM:
    """Runs an EngineCore in this process until every submitted prompt is done."""

    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        *,
        dtype: str | None = None,  # None: bfloat16 on CUDA, float32 on CPU
        device: str = "cpu",
        kernel_backend: str | None = None,
        max_model_len: int | None = None,
        block_size: int = 16,
        kv_cache_bytes: int = 1 << 30,
        num_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 64,
        num_threads: int | None = None,
        seed: int = 0,
        enforce_eager: bool | None = None,  # None: eager; False: compiled step (CPU)
        compile_cache_dir: str | None = None,  # None: <pdserve cache dir>/compile
        kv_layout: str = "layer_major",  # or "block_major" (engine/kv_tensor.py)
        batched_decode: bool = True,  # CPU fp32/bf16: engine/models/fused_decode.py
        keep_plain_weights: bool = False,  # CPU: FusedDecode.release_plain
        prompt_gemm: str = "auto",  # CPU: "onednn", "panel" (FusedDecode.serve_prompt_steps)
        kv_populate: bool = True,  # CPU: fault the KV cache in on a thread (kernels/fault_in.py)
        tensor_parallel_size: int = 1,  # ranks executing each step (engine/tp_runner.py)
    ):
        config = EngineConfig(
            model=ModelConfig(
                model,
                dtype,
                device,
                kernel_backend,
                max_model_len,
                seed,
                enforce_eager=enforce_eager,
                compile_cache_dir=compile_cache_dir,
                batched_decode=batched_decode,
                keep_plain_weights=keep_plain_weights,
                prompt_gemm=prompt_gemm,
            ),
            cache=CacheConfig(
                block_size,
                kv_cache_bytes,
                num_blocks,
                enable_prefix_caching,
                kv_layout=kv_layout,
                kv_populate=kv_populate,
            ),
            scheduler=SchedulerConfig(max_num_batched_tokens, max_num_seqs),
            num_threads=num_threads,
            tensor_parallel_size=tensor_parallel_size,
        )
        self.engine = EngineCore(config)
        # transformers' own: a library user gets its whole API (apply_chat_template, ...)
        self.tokenizer = load_tokenizer(self.engine.model_dir, hf=True)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        token_lists = [self._encode(p) for p in prompts]
        return self._run(token_lists, params, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_lists = [apply_chat_template(self.tokenizer, c) for c in conversations]  # type: ignore[arg-type]
        return self._run(token_lists, params, use_tqdm)

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids", "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def _run(self, token_lists, params, use_tqdm: bool) -> list[RequestOutput]:
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(token_lists)
        if len(plist) != len(token_lists):
            raise InvalidRequestError("need one SamplingParams per prompt", "params")
        for ids, p in zip(token_lists, plist):
            self.engine.validate(ids, p)
        results: dict[str, RequestOutput] = {}
        order = []
        for ids, p in zip(token_lists, plist):
            rid = str(next(self._ids))
            self.engine.add_request(rid, ids, p)
            results[rid] = RequestOutput(rid, ids, logprobs=[] if p.logprobs else None)
            order.append((rid, p))
        pending = set(results)
        streams = {
            rid: OutputStream(
                IncrementalDetokenizer(self.tokenizer, p.stop) if self.tokenizer else None,
                p.logprobs,
            )
            for rid, p in order
        }
        with tqdm(total=len(order), desc="generating", disable=not use_tqdm) as bar:
            while pending:
                for out in self.engine.step():
                    rid = out.request_id
                    stream, res = streams[rid], results[rid]
                    stream.add(out)
                    res.add(stream.take())
                    if rid in pending and res.finish_reason is not None:
                        if stream.stopped_early:  # a stop string ended it
                            self.engine.abort_requests([rid])
                        pending.discard(rid)
                        bar.update(1)
        return [results[rid] for rid, _ in order]
