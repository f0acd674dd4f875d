"""The gateway: HTTP only (never torch, the engine, kv or models). Keys, exact shared limits, billing with
cached input, timeouts, failover. The same admission middleware runs inside `glmserve serve` (in-memory limits,
SQLite ledger) and in `glmserve gateway --backend URL ...` in front of replicas (Redis for shared state).

  settings.py   GatewaySettings: the options both commands share (`add_gateway_options`)
"""
