"""Sparse decode attention: the scorer (indexer) contract, selection, the block and learned indexers, pins.

Its settings (`SparseAttentionParams` per request, `resolve_sparse_params`: request > server > mode default)
live in glmserve/sparse_settings.py, at the floor of config.py, which validates the server's flags with them.

- `indexer`: the contract with the layers it scores (`Indexer`, `ScoringRows`, `ScoredLayer`), `attach_indexers`;
- `selection`: per-row settings as tensors (`SparseRows`) and the batched selection of decode slots;
- `block`: the Quest-style block indexer; `learned`: the distilled per-layer scorer;
- `pinning`: question-pinned units (what the prompt's last queries attend to stays selected during decode).
"""
