"""What `serve --log-interactions DIR` writes, and `POST /v1/feedback`.

One `interaction` line per finished chat or text completion (stream or not): the response `id` the client saw,
the `x-request-id`, endpoint, model, the client's messages or prompt, each choice's raw text, finish reason,
token count and (when the request asked for logprobs) mean logprob, `usage`, the request's `metadata`, and
`prefix_hash` / `regeneration`: the hash of the conversation up to the answer and how many times this server
was asked the same prefix before (a regenerate button). Aborted requests write nothing.

Feedback: `POST /v1/feedback` with `{"id": "<the response id>", "rating": -1 | 0 | 1, "comment": "..."}`
(thumbs down / neutral / up); the `openai` client sends it with `client.post("/feedback", body=..., cast_to=...)`.
It appends a `feedback` line; the id must be one this process logged (404 otherwise, and 404 while logging is
off). Ratings arrive after the answer, so they cannot ride on the request's `metadata`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from glmserve import log_context
from glmserve.engine.outputs import CompletionOutput, RequestOutput
from glmserve.server.errors import APIError
from glmserve.server.interaction_log import InteractionLog
from glmserve.server.protocol import ChatMessage
from glmserve.server.usage import usage_of

REMEMBERED = 100_000  # response ids (for feedback) and prefixes (for regenerations) kept in memory

router = APIRouter()


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: Annotated[str, Field(min_length=1, max_length=200)]
    rating: Annotated[int, Field(ge=-1, le=1)]
    comment: Annotated[str, Field(max_length=4000)] | None = None


class InteractionNotFoundError(APIError):
    """Feedback for a response id this server did not log (or logging is off): 404."""

    status_code = 404
    default_code = "interaction_not_found"


class _Lru(OrderedDict):
    def touch(self, key: str) -> int:
        """How many times `key` was seen before (and remember one more)."""
        seen = self.pop(key, 0)
        self[key] = seen + 1
        if len(self) > REMEMBERED:
            self.popitem(last=False)
        return seen


class Interactions:
    """Builds the log lines; called on the event loop (the writing happens in the log's thread)."""

    def __init__(self, log: InteractionLog) -> None:
        self.log = log
        self._prefixes = _Lru()
        self._ids = _Lru()

    def chat(self, response_id: str, model: str, messages: Sequence[ChatMessage], final: RequestOutput,
             metadata: dict[str, str] | None) -> None:
        logged = [m.model_dump(exclude_none=True) | {"content": m.text()} for m in messages]
        self._submit("chat.completions", response_id, model, {"messages": logged}, [final], metadata)

    def completion(self, response_id: str, model: str, prompts: Sequence[str | list[int]],
                   finals: Sequence[RequestOutput], metadata: dict[str, str] | None) -> None:
        # one line per prompt (each prompt is its own conversation), all with the response's id
        for i, (prompt, final) in enumerate(zip(prompts, finals)):
            self._submit("completions", response_id, model, {"prompt": prompt, "prompt_index": i}, [final],
                         metadata)

    def feedback(self, body: FeedbackRequest) -> None:
        if body.id not in self._ids:
            raise InteractionNotFoundError(f"No logged response with id {body.id!r} (feedback is accepted for the "
                                           f"last {REMEMBERED} responses this server logged).", param="id")
        self.log.submit({"type": "feedback", "id": body.id, "rating": body.rating, "comment": body.comment})

    def _submit(self, endpoint: str, response_id: str, model: str, request: dict[str, Any],
                finals: Sequence[RequestOutput], metadata: dict[str, str] | None) -> None:
        asked = {k: v for k, v in request.items() if k != "prompt_index"}
        prefix = hashlib.sha256(json.dumps([endpoint, model, asked], sort_keys=True, ensure_ascii=False)
                                .encode()).hexdigest()[:32]
        self._ids.touch(response_id)
        self.log.submit({
            "type": "interaction", "id": response_id, "x_request_id": log_context.current(), "time": time.time(),
            "endpoint": endpoint, "model": model, **request,
            "choices": [_choice(c) for final in finals for c in final.outputs],
            "usage": usage_of(finals).model_dump(), "metadata": metadata,
            "prefix_hash": prefix, "regeneration": self._prefixes.touch(prefix),
        })


def _choice(c: CompletionOutput) -> dict[str, Any]:
    out: dict[str, Any] = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                           "completion_tokens": len(c.token_ids)}
    if c.logprobs:
        out["mean_logprob"] = sum(t.logprob for t in c.logprobs) / len(c.logprobs)
    return out


@router.post("/v1/feedback")
async def post_feedback(body: FeedbackRequest, request: Request) -> JSONResponse:
    interactions: Interactions | None = request.app.state.serving.interactions
    if interactions is None:
        raise InteractionNotFoundError("Interaction logging is off (start the server with --log-interactions DIR).",
                                       code="interaction_log_off")
    interactions.feedback(body)
    return JSONResponse({"object": "feedback", "id": body.id, "rating": body.rating})
