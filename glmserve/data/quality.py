"""The learned quality score: logistic regression over a document's sentence embedding (glmserve/embed.py, the
Universal Sentence Encoder of a PyPI wheel) and two length features, trained on labeled records (`valid`
true/false). It plays the seeds' "light model scores semantic quality" part: in `data clean` it is the second
opinion on the rule filters' rejections (a document a web-text threshold rejects is kept when the model is
confident that it is valid) and, optionally, a filter of its own. The shipped weights (quality_model.npz, a few
KB) are retrained by `glmserve data train-quality`."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from glmserve.data.text import prose
from glmserve.errors import InvalidRequestError

SHIPPED_MODEL = Path(__file__).with_name("quality_model.npz")
# duplicates are valid-looking text whose fault is being a copy: MinHash's job, not the model's
NOT_FOR_TRAINING = ("exact_dup", "near_dup")
QUALITY_KEYS = ("model", "rescue_score", "min_score")  # the `quality` step's settings (glmserve/data/config.py)
L2 = 0.01  # chosen by 5-fold cross-validation by source on the tune split (flat from 0.003 to 0.03)


def _length_features(texts: Sequence[str], views: Sequence[str]) -> np.ndarray:
    """log words of the document and the share of its characters that are prose (the rest: code, markup)."""
    words = np.array([len(t.split()) for t in texts], dtype=np.float64)
    share = np.array([len(v) / max(1, len(t)) for t, v in zip(texts, views)], dtype=np.float64)
    return np.stack([np.log1p(words), share], axis=1)


def features(texts: Sequence[str]) -> np.ndarray:
    """(n, 514): the embedding of each text's prose view (the raw text where the view is empty), then the
    length features (unscaled)."""
    from glmserve.embed import embed

    views = [prose(t) for t in texts]
    emb = embed([v if v.strip() else t for t, v in zip(texts, views)]).astype(np.float64)
    return np.concatenate([emb, _length_features(texts, views)], axis=1)


@dataclass(frozen=True)
class QualityModel:
    """p(valid) = sigmoid(weights . z + bias), z = the features with the length columns standardized."""

    weights: np.ndarray
    bias: float
    mean: np.ndarray  # of the length features in training
    scale: np.ndarray

    def _z(self, x: np.ndarray) -> np.ndarray:
        z = x.copy()
        z[:, -2:] = (z[:, -2:] - self.mean) / self.scale
        return z

    def probabilities(self, x: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-(self._z(x) @ self.weights + self.bias)))

    def score(self, texts: Sequence[str]) -> np.ndarray:
        return self.probabilities(features(texts)) if texts else np.zeros(0)

    def save(self, path: str | Path) -> None:
        np.savez_compressed(path, weights=self.weights.astype(np.float32), bias=np.float32(self.bias),
                            mean=self.mean.astype(np.float32), scale=self.scale.astype(np.float32))

    @classmethod
    def load(cls, path: str | Path) -> QualityModel:
        try:
            with np.load(path) as f:
                return cls(f["weights"].astype(np.float64), float(f["bias"]), f["mean"].astype(np.float64),
                           f["scale"].astype(np.float64))
        except (OSError, KeyError, ValueError) as e:
            raise InvalidRequestError(f"cannot read the quality model {path}: {e}") from e


@lru_cache(maxsize=4)
def load_model(path: str | None = None) -> QualityModel:
    """The model at `path`, or the shipped one; loaded once per process."""
    return QualityModel.load(path or SHIPPED_MODEL)


def fit(x: np.ndarray, y: np.ndarray, l2: float = L2, iterations: int = 25) -> QualityModel:
    """L2-regularized logistic regression by Newton's method (IRLS; the bias is not penalized)."""
    if len(set(y.tolist())) < 2:
        raise InvalidRequestError("training needs both valid and invalid records")
    mean, scale = x[:, -2:].mean(axis=0), x[:, -2:].std(axis=0) + 1e-9
    z = x.copy()
    z[:, -2:] = (z[:, -2:] - mean) / scale
    a = np.concatenate([z, np.ones((len(z), 1))], axis=1)
    penalty = np.full(a.shape[1], l2)
    penalty[-1] = 0.0
    theta = np.zeros(a.shape[1])
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-(a @ theta)))
        grad = a.T @ (p - y) + penalty * theta
        hess = (a * (p * (1 - p))[:, None]).T @ a + np.diag(penalty)
        step = np.linalg.solve(hess, grad)
        theta -= step
        if np.abs(step).max() < 1e-8:
            break
    return QualityModel(theta[:-1], float(theta[-1]), mean, scale)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve: the chance that a random valid record outscores a random invalid one
    (Mann-Whitney U with tied ranks averaged)."""
    pos, neg = labels.astype(bool), ~labels.astype(bool)
    if not pos.any() or not neg.any():
        raise InvalidRequestError("AUC needs both valid and invalid records")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    ranks = ((ends - counts + 1 + ends) / 2)[inverse]  # each value's average rank, 1-based
    return float((ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * neg.sum()))


def training_set(records: Sequence[dict]) -> tuple[list[str], np.ndarray]:
    """Texts and 0/1 labels of the records with a boolean `valid`, duplicates left out."""
    rows = [r for r in records if isinstance(r.get("valid"), bool) and r.get("kind") not in NOT_FOR_TRAINING]
    if not rows:
        raise InvalidRequestError("no records with a boolean 'valid' label to train on")
    return [r["text"] for r in rows], np.array([float(r["valid"]) for r in rows])


def quality_filter(min_score: float, model: str | None = None, exclusion_writer=None):
    """The datatrove step that drops documents scored under `min_score` and records every score as `quality`."""
    from datatrove.pipeline.filters.base_filter import BaseFilter

    class QualityFilter(BaseFilter):
        name = "quality"

        def filter(self, doc) -> bool | tuple[bool, str]:
            score = float(load_model(model).score([doc.text])[0])
            doc.metadata["quality"] = round(score, 4)
            return True if score >= min_score else (False, "low_quality_score")

    return QualityFilter(exclusion_writer)


def train(records: Sequence[dict], l2: float = L2) -> QualityModel:
    """The model fitted on the labeled records (see training_set)."""
    texts, y = training_set(records)
    return fit(features(texts), y, l2=l2)


def _group(record: dict) -> str:
    return record["id"] if record.get("source", "generated") == "generated" else record["source"]


def out_of_fold_scores(records: Sequence[dict], folds: int = 5, l2: float = L2) -> tuple[list[dict], np.ndarray]:
    """Each training record's score by a model fitted without its source (k folds by a hash of the source):
    what a threshold is chosen on, since scores of the records a model was fitted on are optimistic."""
    rows = [r for r in records if isinstance(r.get("valid"), bool) and r.get("kind") not in NOT_FOR_TRAINING]
    texts, y = training_set(rows)
    x = features(texts)
    fold = np.array([int(hashlib.sha256(_group(r).encode()).hexdigest(), 16) % folds for r in rows])
    scores = np.zeros(len(rows))
    for k in range(folds):
        scores[fold == k] = fit(x[fold != k], y[fold != k], l2=l2).probabilities(x[fold == k])
    return rows, scores
