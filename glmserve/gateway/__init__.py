"""The gateway: HTTP only (never torch, the engine, kv or models). Keys, exact shared limits, billing with
cached input, timeouts, failover. The same admission middleware runs inside `glmserve serve` (in-memory limits,
SQLite ledger) and in `glmserve gateway --backend URL ...` in front of replicas (Redis for shared state).

  settings.py   GatewaySettings: the options both commands share (`add_gateway_options`)
  admission.py  GatewayMiddleware: keys, limits, billing and /v1/usage around any OpenAI-compatible ASGI app
  keys.py       API keys (TOML [[key]] tables) as SHA-256 hashes, reloaded on change
  limits.py     per-key limits: one atomic Redis Lua script (exact across gateways) or in memory
  prices.py     price table per model with prompt-length tiers, integer micro-USD
  ledger.py     one row per answered request id (SQLite or PostgreSQL)
  usage_stream.py  usage out of JSON bodies and SSE streams
  openai_errors.py OpenAI's error bodies and x-ratelimit headers
  metrics.py    Prometheus counters of admission and billing
"""
