"""POST /v1/compress: semantic context compression with its trace map (glmserve/compress/).

Body: `documents` [{`id`, `text`}], optional `query`, at most one of `target_ratio`, `target_tokens`,
`preset` (short / medium / long). Answer: `text`, `original_tokens`, `compressed_tokens` (in the served
model's tokenizer), `ratio`, `spans` [{`doc`, `start`, `end`, `section`, `paragraph`, `page`, `kind`,
`anchors`}] and `documents` [{`id`, `mode`, `reason`, `original_tokens`}]. Runs in a worker thread.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from glmserve.compress import Document, compress
from glmserve.compress.tokens import HFTokenCounter
from glmserve.errors import InvalidRequestError
from glmserve.server.errors import BadRequestError

router = APIRouter()

MAX_DOCUMENTS = 64


class CompressDocument(BaseModel):
    id: str = Field(min_length=1, max_length=256)
    text: str


class CompressRequest(BaseModel):
    documents: list[CompressDocument] = Field(min_length=1, max_length=MAX_DOCUMENTS)
    query: str | None = None
    target_ratio: float | None = None
    target_tokens: int | None = None
    preset: str | None = None


@router.post("/v1/compress")
async def create_compression(body: CompressRequest, request: Request) -> JSONResponse:
    serving = request.app.state.serving
    serving.loaded()
    counter = HFTokenCounter(serving.engine.tokenizer)
    docs = [Document(d.id, d.text) for d in body.documents]
    try:
        result = await asyncio.to_thread(compress, docs, body.query, body.target_ratio, body.target_tokens,
                                         body.preset, counter)
    except InvalidRequestError as exc:
        raise BadRequestError(str(exc)) from exc
    return JSONResponse(result.to_dict())
