"""The synchronous engine: requests in, one scheduler step at a time, outputs back.

A request with n samples starts as one sequence; when its prompt is computed, the other
samples are admitted and share the prompt's KV blocks through the prefix cache. A request whose
session KV is being read (glmserve/kv/session_io.py) waits outside the scheduler until the read is
done, then joins the waiting queue with its chunks loaded as prefix-cache blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from glmserve import log_context
from glmserve.config import EngineConfig
from glmserve.engine.detokenizer import IncrementalDetokenizer
from glmserve.engine.outputs import CompletionOutput, EngineStats, RequestOutput, StorageStats
from glmserve.engine.runner import ModelRunner
from glmserve.engine.sampling import SamplingParams
from glmserve.engine.scheduler import Scheduler
from glmserve.engine.sequence import Sequence
from glmserve.engine.structured import GrammarCompiler
from glmserve.errors import InvalidRequestError, PromptTooLongError
from glmserve.kv.kv_format import default_kv_format, kv_format
from glmserve.kv.session_io import PendingRestore, wait_for_any
from glmserve.kv.stack import KVStack, kv_budget_bytes, plan_pool
from glmserve.models.loader import load_model
from glmserve.native_heap import reuse_freed_memory
from glmserve.sparse.block import (
    attach_block_indexers,
    block_bounds_bytes,
    gather_block_bounds,
    refresh_block_bounds,
)
from glmserve.sparse.indexer import ScoredLayer
from glmserve.sparse.learned import attach_learned_indexers, find_learned_indexer, index_key_bytes_per_token
from glmserve.sparse_settings import SparseAttentionParams, resolve_sparse_params

RESTORE_POLL_S = 0.02  # with nothing else to run, how long a step waits for a session read

logger = logging.getLogger(__name__)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    pending_samples: list[Sequence] = field(default_factory=list)  # admitted once the prompt is computed
    session_id: str | None = None  # its KV is saved to the session store when sample 0 finishes
    log_id: str = log_context.NO_REQUEST  # the id its log lines name (glmserve/log_context.py)

    @property
    def finished(self) -> bool:
        return not self.pending_samples and all(s.is_finished for s in self.seqs)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        reuse_freed_memory()  # before the load: the step's activations reuse freed heap memory (native_heap.py)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        loaded = load_model(config.model, config.tokenizer, self.device, self.dtype, config.quantization,
                            config.quantize_embeddings)
        self.kv_format = (default_kv_format(self.dtype, self.device, getattr(loaded.model, "reads_quantized_kv", False))
                          if config.kv_cache_dtype == "auto" else kv_format(config.kv_cache_dtype))
        side_dtype = self.dtype if self.kv_format.quantized else self.kv_format.storage  # the block bounds' dtype
        scored_layers = loaded.model.paged_attention_layers()  # where sparse scorers attach (none for MLA)
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.model_name = config.served_model_name or loaded.name
        self.max_model_len = min(config.max_model_len or loaded.max_position_embeddings, loaded.max_position_embeddings)
        self.learned_indexer = find_learned_indexer(config.learned_indexer, config.model, loaded.model)
        bytes_per_block = (config.block_size * loaded.model.kv_bytes_per_token(self.kv_format)
                           + self._sparse_bytes_per_block(scored_layers, side_dtype))
        plan = plan_pool(kv_budget_bytes(config.kv_cache_memory_bytes, self.device), bytes_per_block,
                         config.block_size, self.max_model_len,
                         offload_supported=bool(getattr(loaded.model, "supports_kv_offload", False)),
                         chunk_tokens=config.kv_chunk_tokens, max_num_batched_tokens=config.max_num_batched_tokens,
                         host_memory_bytes=config.kv_host_memory_bytes, disk_dir=config.kv_disk_dir,
                         device=self.device)
        self.runner = ModelRunner(loaded.model, plan.num_blocks, config.block_size, self.kv_format, self.device)
        load_listeners, block_bounds = self._attach_sparse_indexers(scored_layers, plan.num_blocks, side_dtype)
        default_mode = config.sparse_attention or ("native" if "native" in self.sparse_modes else "dense")
        self.default_sparse = self.resolve_sparse({"mode": default_mode})
        self.kv = KVStack.build(
            plan, loaded.model, self.runner.kv_cache, config.model or f"embedded:{loaded.name}", self.dtype,
            self.kv_format,
            prefix_caching=config.enable_prefix_caching, chunk_tokens=config.kv_chunk_tokens,
            disk_dir=config.kv_disk_dir, disk_bytes=config.kv_disk_bytes,
            host_memory_bytes=config.kv_host_memory_bytes, session_store=config.session_store,
            session_max_bytes=config.session_max_bytes, session_ttl_s=config.session_ttl_s,
            load_listeners=load_listeners, block_bounds=block_bounds)
        self.runner.offload = self.kv.offload
        self.scheduler = Scheduler(self.kv.blocks, config.max_num_seqs, config.max_num_batched_tokens, self.kv.offload)
        self.requests: dict[str, Request] = {}
        self.grammars = GrammarCompiler(self.tokenizer, loaded.model.config.vocab_size, sorted(self.eos_token_ids))
        self.restoring: dict[str, tuple[Request, PendingRestore]] = {}  # waiting for their session's KV
        self.requests_received = 0  # add_request calls, valid or not (what reached the engine)

    # -- sparse attention -------------------------------------------------------------------------
    def _sparse_bytes_per_block(self, layers: list[ScoredLayer], kv_dtype: torch.dtype) -> int:
        """Bytes per pool block of the sparse side pools: block-indexer bounds, learned-indexer keys."""
        size = block_bounds_bytes(layers, kv_dtype) if self.config.sparse_block_bounds else 0
        if self.learned_indexer is not None:
            size += self.config.block_size * index_key_bytes_per_token(self.learned_indexer)
        return size

    def _attach_sparse_indexers(self, layers: list[ScoredLayer], num_blocks: int, kv_dtype: torch.dtype
                                ) -> tuple[list[Callable[[torch.Tensor], None]], Callable | None]:
        """Attaches the block and learned indexers beside the pool; returns the KV load listeners that refresh
        them, and the block-bounds gather that offloaded chunks keep (None without the block indexer)."""
        config = self.config
        if config.sparse_block_bounds and block_bounds_bytes(layers, kv_dtype):
            attach_block_indexers(layers, num_blocks, config.block_size, kv_dtype, self.device)
        self.index_keys = None if self.learned_indexer is None else attach_learned_indexers(
            layers, self.learned_indexer, self.runner.kv_cache, config.block_size)
        listeners = [] if self.index_keys is None else [self.index_keys.refresh]
        if "block" not in self.sparse_modes:
            return listeners, None
        # loaded K/V never passes through attention: recompute its bounds
        listeners.append(functools.partial(refresh_block_bounds, layers))
        return listeners, functools.partial(gather_block_bounds, layers)

    @property
    def sparse_modes(self) -> tuple[str, ...]:
        """Sparse attention modes this engine can serve now (a learned indexer may be attached later)."""
        return self.runner.model.sparse_modes()

    def resolve_sparse(self, sparse: SparseAttentionParams | dict | None) -> SparseAttentionParams:
        """A request's sparse settings: None = the server default; a dict overrides the server's flags
        field by field ({"mode": "block", "top_k": 1024}); raises InvalidRequestError if unavailable."""
        if sparse is None:
            return self.default_sparse
        if isinstance(sparse, dict):
            request = {k: v for k, v in sparse.items() if k != "mode"}
            mode = sparse.get("mode") or self.default_sparse.mode
            sparse = resolve_sparse_params(mode, request, self.config.sparse_flags())
        if sparse.mode not in self.sparse_modes:
            reason = {
                "native": "this model has no built-in sparse indexer (only GLM-5.x / DeepSeek-V3.2 do)",
                "learned": "no learned indexer is loaded for this model",
                "block": "the block indexer's key bounds are off (sparse_block_bounds) or the model has none",
            }.get(sparse.mode, "")
            raise InvalidRequestError(
                f"sparse attention mode {sparse.mode!r} is not available: {reason}; available: {self.sparse_modes}"
            )
        return sparse

    # -- requests ---------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> list[int]:
        """`template_kwargs`: extra variables for the template (e.g. `enable_thinking`)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model's tokenizer has no chat template; use a completion prompt")
        out = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                 **(template_kwargs or {}))
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        vocab = self.runner.model.config.vocab_size
        if prompt and (min(prompt) < 0 or max(prompt) >= vocab):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None,
                    sparse: SparseAttentionParams | dict | None = None, session_id: str | None = None,
                    log_id: str = log_context.NO_REQUEST) -> None:
        """`session_id`: load the session's stored KV for the prompt's prefix, save the turn's KV at its end.
        `log_id`: the id that engine-side log lines about this request name (the HTTP request's)."""
        self.requests_received += 1
        with log_context.about(log_id):
            self._add_request(request_id, prompt, params, priority, cache_salt, sparse, session_id, log_id)

    def _add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int,
                     cache_salt: str | None, sparse: SparseAttentionParams | dict | None, session_id: str | None,
                     log_id: str) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        sparse = self.resolve_sparse(sparse)
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        if len(token_ids) > self.max_model_len or (len(token_ids) == self.max_model_len and params.max_tokens != 0):
            raise PromptTooLongError(len(token_ids), self.max_model_len)  # max_tokens 0 may fill the context
        if session_id is not None and self.kv.sessions is None:
            raise InvalidRequestError("sessions are off on this server (session_store 'off')")
        vocab = self.runner.model.config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})")
        # a cache hit when the server compiled it beforehand (off this thread)
        grammar = self.grammars.compile(params.guided) if params.guided is not None else None
        seqs = [
            Sequence(request_id, i, token_ids, params,
                     IncrementalDetokenizer(self.tokenizer, token_ids, params.stop, params.skip_special_tokens),
                     priority, cache_salt, sparse, log_id)
            for i in range(params.n)
        ]
        for seq in seqs if grammar is not None else ():
            seq.matcher = grammar.matcher()
        request = Request(request_id, token_ids, params, seqs, pending_samples=seqs[1:], session_id=session_id,
                          log_id=log_id)
        logger.debug("request %s added: %d prompt tokens, %d samples%s", request_id, len(token_ids), params.n,
                     f", session {session_id}" if session_id is not None else "")
        restore = None
        if session_id is not None:
            restore = self.kv.sessions.start_restore(session_id, token_ids, cache_salt)  # type: ignore[union-attr]
        self.requests[request_id] = request
        if restore is None:
            self.scheduler.add(seqs[0])
        else:
            self.restoring[request_id] = (request, restore)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        with log_context.about(request.log_id):
            logger.info("request %s aborted (%d tokens generated)", request_id, request.seqs[0].num_output_tokens)
            self.restoring.pop(request_id, None)
            self._save_session(request.seqs[0], partial=True)  # the KV it computed, before its blocks are freed
            del self.requests[request_id]
            for seq in request.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self.scheduler.remove(seq)
            request.pending_samples.clear()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- stepping ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._admit_restored()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        results = self.runner.execute(batch)
        prompt_only = [item.seq for item in batch if item.completes and not item.samples]  # max_tokens 0
        touched: dict[str, Request] = {}
        for item in batch:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.kv.blocks.register_full_blocks(seq.kv)
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                touched[seq.request_id] = self.requests[seq.request_id]
        for seq, token, logprob in results:
            seq.append_token(token, logprob)
            self._check_stop(seq, token)
            if seq.finish_reason is not None:
                self._finish(seq)
        for seq in prompt_only:
            seq.finish_reason = "length"
            self._finish(seq)
        for request in touched.values():
            self._admit_pending_samples(request)
        return [self._output(r) for r in touched.values()]

    def _finish(self, seq: Sequence) -> None:
        with log_context.about(seq.log_id):
            logger.debug("request %s sample %d finished (%s): %d tokens generated", seq.request_id, seq.index,
                         seq.finish_reason, seq.num_output_tokens)
            self._save_session(seq)
            self.scheduler.remove(seq)

    def _admit_restored(self) -> None:
        """Requests whose session KV has been read: load it into the pool (one chunk per step while others
        run), then let them be scheduled. With nothing else to run, wait a little for a read rather than spin."""
        if not self.restoring:
            return
        idle = not (self.scheduler.running or self.scheduler.waiting)
        if idle:
            wait_for_any([restore for _, restore in self.restoring.values()], RESTORE_POLL_S)
        for request_id, (request, restore) in list(self.restoring.items()):
            if not restore.done():
                continue
            with log_context.about(request.log_id):
                if self.kv.sessions.load_restored(restore, None if idle else 1):  # type: ignore[union-attr]
                    del self.restoring[request_id]
                    self.scheduler.add(request.seqs[0])

    def _save_session(self, seq: Sequence, partial: bool = False) -> None:
        """Sample 0 of a session's request ends: its KV goes to the session store. `partial`: the turn was cut
        short (abort, shutdown), and sample 0 may have finished and been saved already."""
        session_id = self.requests[seq.request_id].session_id
        if session_id is not None and seq.index == 0 and self.kv.sessions is not None and not seq.is_finished:
            resident = seq.kv.resident_prefix_blocks()  # up to its first offloaded block, if any
            computed = min(seq.num_computed_tokens, resident * self.config.block_size)
            self.kv.sessions.save(session_id, seq.token_ids, seq.kv.block_table[:resident], computed, partial)

    def close(self) -> None:
        """Save the KV that unfinished session turns computed, then finish background work (session writes, KV
        tier disk writes), so that a restart finds it; the engine must not be used afterwards."""
        for request in self.requests.values():
            with log_context.about(request.log_id):
                self._save_session(request.seqs[0], partial=True)
        self.kv.close()

    def _admit_pending_samples(self, request: Request) -> None:
        for seq in request.pending_samples:
            self.scheduler.add(seq)
        request.pending_samples.clear()

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        stop_string = seq.detokenize(token)
        reason: tuple[str, str | int | None] | None = None
        if stop_string is not None:
            reason = ("stop", stop_string)
        elif seq.matcher is not None and (not seq.matcher.consume_token(token) or seq.matcher.is_stopped()):
            reason = ("stop", None)  # the grammar is complete (or, never expected, refused the token)
        elif seq.num_output_tokens >= params.min_tokens and (
            token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        ):
            reason = ("stop", token if token in params.stop_token_ids else None)
        elif (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) or (
            seq.num_tokens >= self.max_model_len
        ):
            reason = ("length", None)
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason

    def _output(self, request: Request) -> RequestOutput:
        finished = request.finished
        if finished:
            self.requests.pop(request.request_id, None)
        outputs = [
            CompletionOutput(
                index=s.index,
                text=s.detokenizer.visible_text(s.is_finished),
                token_ids=s.output_token_ids,
                text_ends=list(s.text_ends),
                logprobs=list(s.logprobs) if s.logprobs is not None else None,  # a snapshot across threads
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in request.seqs
        ]
        first = request.seqs[0]
        scores = first.prompt_scores
        prompt_logprobs = scores.as_list(request.prompt_token_ids) if scores is not None and scores.complete else None
        return RequestOutput(request.request_id, request.prompt_token_ids, first.kv.num_cached_tokens, outputs,
                             finished, first.arrival_time, first.first_scheduled_time, prompt_logprobs)

    def stats(self) -> EngineStats:
        bm = self.kv.blocks
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.restoring),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_usable_blocks,
            kv_cache_usage=1.0 - bm.num_free_blocks / bm.num_usable_blocks,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            requests_received=self.requests_received,
        )

    def storage_stats(self) -> StorageStats:
        """KV tier, session store and KV offload traffic and bytes, read now (safe from any thread)."""
        tiers, sessions, offload = self.kv.tiers, self.kv.sessions, self.kv.offload
        host = tiers.host if tiers is not None else None
        disk = tiers.disk if tiers is not None else None
        return StorageStats(
            tiers=dataclasses.replace(tiers.stats) if tiers is not None else None,
            host_tier_bytes=host.index.nbytes if host is not None else 0,
            disk_tier_bytes=disk.nbytes if disk is not None else 0,
            sessions=dataclasses.replace(sessions.stats) if sessions is not None else None,
            session_store_bytes=sessions.store_bytes() if sessions is not None else 0,
            offload=offload.snapshot() if offload is not None else None,
        )

    # -- sessions (safe from any thread: the server calls these from worker threads) -------------------
    @property
    def sessions_enabled(self) -> bool:
        return self.kv.sessions is not None

    def session_info(self, session_id: str) -> dict | None:
        """The stored session's turns, tokens, bytes and summary; None when unknown, expired or sessions are off."""
        return None if self.kv.sessions is None else self.kv.sessions.info(session_id)

    def delete_session(self, session_id: str) -> bool:
        """Drops the session's KV and record; False when there was no such session (or sessions are off)."""
        return self.kv.sessions is not None and self.kv.sessions.delete(session_id)

    def session_summary(self, session_id: str) -> dict | None:
        """The session's anchoring summary (glmserve/server/anchoring.py), or None."""
        return None if self.kv.sessions is None else self.kv.sessions.summary(session_id)

    def set_session_summary(self, session_id: str, summary: dict | None) -> None:
        if self.kv.sessions is None:
            raise InvalidRequestError("sessions are off on this server (session_store 'off')")
        self.kv.sessions.set_summary(session_id, summary)
