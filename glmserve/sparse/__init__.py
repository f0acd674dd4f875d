"""Sparse decode attention: settings, the scorer (indexer) contract, selection and the block indexer.

- `settings`: `SparseAttentionParams` (per request) and `resolve_sparse_params` (request > server > mode default);
- `indexer`: the contract with the layers it scores (`Indexer`, `ScoringRows`, `ScoredLayer`), `attach_indexers`;
- `selection`: per-row settings as tensors (`SparseRows`) and the batched selection of decode slots;
- `block`: the Quest-style block indexer; `learned`: the distilled per-layer scorer;
- `pinning`: question-pinned units (what the prompt's last queries attend to stays selected during decode).
"""

from glmserve.sparse.settings import DEFAULT_DSA_THRESHOLD, MODES, SparseAttentionParams, resolve_sparse_params

__all__ = ["DEFAULT_DSA_THRESHOLD", "MODES", "SparseAttentionParams", "resolve_sparse_params"]
