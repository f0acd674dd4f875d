"""OpenAI's error bodies and rate-limit headers, sent straight over ASGI (the gateway has no web framework)."""

from __future__ import annotations

import json
import math

from starlette.types import Send

from glmserve.gateway.limits import NO_LIMIT, Decision


async def send_json(send: Send, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def error_body(message: str, error_type: str, code: str | None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def duration(seconds: float) -> str:
    """A wait as OpenAI's reset headers write it: "20ms", "1s", "6m0s", "1h2m3s"."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours >= 1:
        return f"{int(hours)}h{int(minutes)}m{text}"
    return f"{int(minutes)}m{text}" if minutes >= 1 else text


def ratelimit_headers(decision: Decision) -> dict[str, str]:
    """x-ratelimit-{limit,remaining,reset}-{requests,tokens}: the requests figures are the rpm bucket's when the
    key has an rpm limit, else the rps/burst bucket's; tokens are the tpm bucket's. Unlimited figures are left out."""
    lim = decision.limits
    headers: dict[str, str] = {}
    if lim.rpm != NO_LIMIT and decision.rpm_left is not None:
        level, cap, rate = decision.rpm_left, lim.rpm, lim.rpm / 60
    elif lim.rps != NO_LIMIT and decision.requests_left is not None:
        level, cap, rate = decision.requests_left, lim.burst, lim.rps
    else:
        level = None
    if level is not None:
        headers["x-ratelimit-limit-requests"] = str(cap)
        headers["x-ratelimit-remaining-requests"] = str(max(0, math.floor(level)))
        headers["x-ratelimit-reset-requests"] = duration((cap - level) / rate)
    if lim.tpm != NO_LIMIT and decision.tokens_left is not None:
        level = decision.tokens_left
        headers["x-ratelimit-limit-tokens"] = str(lim.tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(level)))
        headers["x-ratelimit-reset-tokens"] = duration((lim.tpm - level) / (lim.tpm / 60))
    return headers


def retry_headers(wait_s: float) -> dict[str, str]:
    return {"retry-after": str(max(1, math.ceil(wait_s))), "retry-after-ms": str(max(1, math.ceil(wait_s * 1000)))}
