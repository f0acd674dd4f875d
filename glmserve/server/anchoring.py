"""Multi-turn state anchoring: a long session stays short by standing its earlier turns in for a summary.

With `session_summary: true` on a chat request that belongs to a session, a conversation whose prompt
is longer than the server's `session_summary_threshold` tokens reaches the engine as: one system
message (the original system message(s), then the summary of the earlier turns: a system prefix),
followed by the most recent messages verbatim (at least the last `session_summary_keep`, starting at a
user message). The summary is written by the model itself from a summarization prompt (greedy with a
repetition penalty; at most `SUMMARY_MAX_TOKENS` tokens and half the threshold) and kept in the
session's record, so later turns reuse it unchanged (the prompt's prefix stays the same, and so its KV
is found in the session store) until the conversation outgrows the threshold again; then the old
summary and the turns it did not cover become a new one. A client that changes the messages a summary
covered (their hash differs) gets a fresh summary.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import asdict, dataclass

from glmserve.engine.sampling import SamplingParams
from glmserve.server.errors import BadRequestError
from glmserve.server.generation import Generation
from glmserve.server.protocol import ChatMessage
from glmserve.server.state import ServedModel, ServingContext

SUMMARY_MAX_TOKENS = 512
SUMMARY_HEADER = "Summary of the earlier conversation:"
SUMMARIZER_SYSTEM = "You write short, factual summaries of conversations."
SUMMARIZE_INSTRUCTION = (
    "Summarize the conversation below in a few sentences. Keep every name, number, fact and decision "
    "that later turns may refer to."
)
SUMMARY_REPETITION_PENALTY = 1.3  # small models loop on greedy summaries without it
TEMPLATE_ROOM = 64  # tokens the chat template and the instruction take around the transcript


@dataclass
class Summary:
    text: str
    num_messages: int  # leading non-system messages it stands in for
    messages_hash: str
    num_tokens: int


def _hash(messages: list[ChatMessage]) -> str:
    data = json.dumps([(m.role, m.text()) for m in messages]).encode()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _compose(system: list[ChatMessage], summary: Summary | None, turns: list[ChatMessage]) -> list[ChatMessage]:
    if summary is None:
        return system + turns
    parts = [m.text() for m in system] + [f"{SUMMARY_HEADER} {summary.text}"]
    return [ChatMessage(role="system", content="\n\n".join(parts))] + turns[summary.num_messages:]


def _stored_summary(stored: dict | None, turns: list[ChatMessage]) -> Summary | None:
    """The session's summary when it still stands for the start of these turns."""
    if not stored:
        return None
    summary = Summary(**stored)
    if summary.num_messages > len(turns) or _hash(turns[:summary.num_messages]) != summary.messages_hash:
        return None
    return summary


async def anchor_messages(messages: list[ChatMessage], session_id: str, model: ServedModel,
                          ctx: ServingContext) -> list[ChatMessage]:
    """The messages to send to the engine for this turn (see the module docstring)."""
    if not ctx.engine.sessions_enabled:
        raise BadRequestError("session_summary needs sessions, which are off on this server", param="session_summary")
    num_system = next((i for i, m in enumerate(messages) if m.role not in ("system", "developer")), len(messages))
    system, turns = list(messages[:num_system]), list(messages[num_system:])
    summary = _stored_summary(await ctx.engine.session_summary(session_id), turns)
    composed = _compose(system, summary, turns)
    if len(model.chat_prompt(composed)) <= ctx.config.session_summary_threshold:
        return composed
    covered = summary.num_messages if summary else 0
    cut = len(turns) - ctx.config.session_summary_keep
    while cut > covered and turns[cut].role != "user":  # the verbatim part starts with a user message
        cut -= 1
    if cut <= covered:
        return composed
    text, num_tokens = await _summarize(ctx, model, summary, turns[covered:cut])
    if not text:
        return composed
    summary = Summary(text, cut, _hash(turns[:cut]), num_tokens)
    await ctx.engine.set_session_summary(session_id, asdict(summary))
    return _compose(system, summary, turns)


async def _summarize(ctx: ServingContext, model: ServedModel, previous: Summary | None,
                     turns: list[ChatMessage]) -> tuple[str, int]:
    """The model's summary of `previous` + `turns`, and its length in tokens."""
    lines = [f"{SUMMARY_HEADER} {previous.text}"] if previous else []
    lines += [f"{m.role.capitalize()}: {m.text()}" for m in turns]
    transcript = "\n".join(lines)
    room = model.max_model_len - SUMMARY_MAX_TOKENS - TEMPLATE_ROOM
    ids = model.encode(transcript)
    if len(ids) > room:  # the most recent part of what is summarized matters most
        transcript = model.decode(ids[-room:])
    prompt_ids = model.chat_prompt([
        ChatMessage(role="system", content=SUMMARIZER_SYSTEM),
        ChatMessage(role="user", content=f"{SUMMARIZE_INSTRUCTION}\n\n{transcript}"),
    ])
    limit = min(SUMMARY_MAX_TOKENS, ctx.config.session_summary_threshold // 2)
    max_tokens = max(1, min(limit, model.max_model_len - len(prompt_ids)))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, repetition_penalty=SUMMARY_REPETITION_PENALTY)
    generation = Generation(ctx.engine, ctx.metrics, prompt_ids, params, f"summary-{uuid.uuid4().hex}")
    try:
        await generation.start()
        final = await generation.final()
    finally:
        generation.abort()
    out = final.outputs[0]
    return out.text.strip(), len(out.token_ids)
