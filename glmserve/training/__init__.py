"""Training that serves inference: what glmserve learns offline from a model (learned-indexer distillation,
`indexer_distill`, CLI `glmserve train-indexer`). Sits above the engine's floors; nothing below imports it."""
