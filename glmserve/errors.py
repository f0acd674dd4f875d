"""Typed errors that user-facing layers (CLI, HTTP server) turn into clear messages."""


class GlmServeError(Exception):
    """Base class of every error glmserve raises on purpose."""


class InvalidRequestError(GlmServeError, ValueError):
    """A request or option has an invalid value; the message says which and why."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one generated token) does not fit in max_model_len."""

    def __init__(self, num_tokens: int, max_model_len: int):
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_tokens} tokens (at least one token must be left for the completion)."
        )


class UnsupportedModelError(GlmServeError, ValueError):
    """The checkpoint's architecture or format is not supported."""


class IndexerMismatchError(GlmServeError, ValueError):
    """A learned-indexer file is unreadable, of another format version, or was trained for another model."""


class UnsupportedKVFormatError(InvalidRequestError):
    """The model's KV cache layout cannot be stored in the requested KV format (`--kv-cache-dtype`)."""


class EngineOverloadedError(GlmServeError):
    """The waiting queue is full; the caller should retry later."""


class SessionStoreUnavailableError(GlmServeError):
    """The session store cannot be reached (Redis down, say): sessions cost a recompute until it is back."""


class KernelBuildError(GlmServeError):
    """A C++ kernel failed to build where the kernels are required (CI=true)."""


class DataPipelineError(GlmServeError):
    """A data pipeline stage did not finish (a task failed on a Ray cluster, or the cluster is unreachable)."""
