"""Offline training-data pipeline: cleaning on datatrove (quality filters, MinHash dedup, local executor), PII
scrubbing, the labeled noisy corpus for the benchmark. Imports no engine, model or server code (the gateway|data
floor of pyproject's import contracts)."""
