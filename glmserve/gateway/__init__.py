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
  app.py        `glmserve gateway`: the ASGI app in front of the backends (/health, /v1/health, /metrics, /v1/models)
  deadline.py   --request-timeout inside `glmserve serve`: 504 or an SSE error event, the engine request aborted
  standby.py    --standby inside `glmserve serve`: what the server cannot take (not ready, queue full) goes there
  proxy.py      forwarding: timeouts (connect, first byte, idle), retries elsewhere, SSE error on a cut stream
  proxy_options.py  the options of `glmserve gateway` alone (--backend, --models, timeouts, ejection, routing)
  backends.py   the pool: /v1/health probes, load from /metrics, in-flight counts, standbys
  breaker.py    a circuit breaker per backend (passive ejection)
  router.py     session -> consistent hashing with bounded loads, else prefix affinity, else least loaded
  models_map.py the model-ID adapter (external ids -> canonical model and backend pool)
  sse.py        SSE relay: whole events, the model id echoed, [DONE] noticed; error events
  retry_budget.py  retries capped as a share of traffic
  proxy_metrics.py glmserve_gateway_* metrics of the proxy
"""
