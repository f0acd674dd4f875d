"""Offline API: `LLM(model=...).generate(prompts, params)` and `.chat(messages, params)`."""

from __future__ import annotations

import itertools

from glmserve.config import EngineConfig
from glmserve.engine.llm_engine import LLMEngine
from glmserve.engine.outputs import RequestOutput
from glmserve.engine.sampling import SamplingParams
from glmserve.sparse_settings import SparseAttentionParams


class LLM:
    def __init__(self, model: str | None = None, **options):
        self.engine = LLMEngine(EngineConfig(model=model, **options))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        sparse: SparseAttentionParams | dict | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion, batched by the scheduler; outputs in prompt order.
        `sparse`: decode attention settings for every prompt (None: the engine's default)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = []
        try:
            for prompt, p in zip(prompts, params_list):
                ids.append(str(next(self._ids)))
                self.engine.add_request(ids[-1], prompt, p, sparse=sparse)
            finished: dict[str, RequestOutput] = {}
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return [finished[i] for i in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        sparse: SparseAttentionParams | dict | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.engine.apply_chat_template(c) for c in conversations], params, sparse)
