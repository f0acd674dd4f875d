"""The quality model: logistic regression by Newton's method, AUC with ties, the shipped weights on real
sentence embeddings, `glmserve data train-quality`, and its rescue of rule rejections in `data clean`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from glmserve.cli import main
from glmserve.data.quality import SHIPPED_MODEL, QualityModel, auc, fit, load_model
from glmserve.data.records import read_records, write_records

VALID = [
    "The scheduler keeps a queue of waiting requests and admits them while the token budget allows it.",
    "Quantized weights are repacked once when the model is loaded, so that the kernels read them quickly.",
    "A session keeps its key and value cache between the turns of a conversation with the same user.",
    "The licensor grants you a perpetual, worldwide, royalty-free license to reproduce the work.",
    "Each step runs the decodes first, then the chunked prefills that still fit in the remaining budget.",
    "Sessions that were not used for a day are dropped, and the least recently used ones go first.",
]
NOISE = [
    "cheap best buy online discount free shipping deal sale offer now cheap best buy online discount",
    "Home | About | Products | Pricing | Blog | Contact Home | About | Products | Pricing",
    "2024-01-03 12:00:01 INFO worker-3 ok id=3 2024-01-04 12:00:02 INFO worker-4 ok id=4",
    "We use cookies to improve your experience. Accept all cookies. Privacy policy. Sign in. Back to top.",
    "var a0=function(t,e){return t.map(function(n){return n*2+e})};var b1=function(t,e){return t}",
    "ZXhhbXBsZSBiYXNlNjQgYmxvYiBvZiByYW5kb20gYnl0ZXMgdGhhdCBpcyBub3QgcHJvc2UgYXQgYWxs",
]


def test_fit_separates_and_auc_counts_ties():
    rng = np.random.default_rng(0)
    y = np.repeat([1.0, 0.0], 50)
    x = np.concatenate([rng.normal(size=(100, 3)) + y[:, None] * 2, rng.uniform(1, 5, size=(100, 2))], axis=1)
    model = fit(x, y)
    assert auc(model.probabilities(x), y) > 0.95
    assert auc(np.array([0.5, 0.5, 0.5]), np.array([1, 0, 0])) == 0.5
    assert auc(np.array([0.9, 0.1]), np.array([1, 0])) == 1.0


def test_shipped_model_is_small_and_tells_prose_from_noise(tmp_path: Path):
    assert SHIPPED_MODEL.stat().st_size < 8_000
    scores = load_model().score(VALID + NOISE)
    assert auc(scores, np.array([1.0] * len(VALID) + [0.0] * len(NOISE))) >= 0.9
    path = tmp_path / "m.npz"
    load_model().save(path)
    again = QualityModel.load(path)
    assert np.allclose(again.score(VALID[:2]), scores[:2], atol=1e-5)


@pytest.mark.slow
def test_train_quality_cli_on_labeled_files(tmp_path: Path, capsys):
    def labeled(texts, valid, tag):
        return [{"id": f"{tag}{i}", "text": t, "valid": valid, "source": f"{tag}{i}"} for i, t in enumerate(texts)]

    write_records(tmp_path / "train.jsonl", labeled(VALID[:4], True, "v") + labeled(NOISE[:4], False, "n"))
    write_records(tmp_path / "heldout.jsonl", labeled(VALID[4:], True, "hv") + labeled(NOISE[4:], False, "hn"))
    main(["data", "train-quality", "--train", str(tmp_path / "train.jsonl"), "--heldout",
          str(tmp_path / "heldout.jsonl"), "--out", str(tmp_path / "q.npz")])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["trained_on"] == 8 and out["heldout"] == 4 and out["heldout_auc"] >= 0.75
    assert QualityModel.load(tmp_path / "q.npz").weights.shape == (514,)


@pytest.mark.parametrize("quality,message", [
    ({"model": "missing.npz"}, "cannot read the quality model missing.npz"),
    ({"rescue": 0.5}, "config step 'quality': unknown keys ['rescue']"),
])
def test_bad_quality_settings_are_clear_errors(tmp_path: Path, capsys, quality: dict, message: str):
    write_records(tmp_path / "in.jsonl", [{"id": "a", "text": VALID[0]}])
    (tmp_path / "cfg.json").write_text(json.dumps({"quality": quality}))
    with pytest.raises(SystemExit):
        main(["data", "clean", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out"), "--config",
              str(tmp_path / "cfg.json")])
    assert message in capsys.readouterr().err


def test_clean_rescues_a_rule_rejection_only_with_the_quality_step_on(tmp_path: Path):
    # a list-shaped README: FineWeb's line-punctuation rule rejects it (no item ends with a mark)
    readme = "Features of the tool\n\n" + "\n".join(f"* option number {i} changes the output format of the report"
                                                    for i in range(30))
    write_records(tmp_path / "in.jsonl", [{"id": "readme", "text": readme}])
    for name, quality in (("on", {"rescue_score": 0.0}), ("off", False)):
        cfg = tmp_path / f"{name}.json"
        cfg.write_text(json.dumps({"quality": quality, "minhash": False, "gopher_repetition": False,
                                   "gopher_quality": False, "c4_quality": False}))
        main(["data", "clean", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / name), "--config", str(cfg)])
    kept = list(read_records(tmp_path / "on" / "kept.jsonl"))
    assert [r["id"] for r in kept] == ["readme"] and kept[0]["rescued"] == "fineweb_quality:line_punct_ratio"
    report = json.loads((tmp_path / "on" / "report.json").read_text())
    assert report["rescued_by_quality"] == {"fineweb_quality:line_punct_ratio": 1}
    assert [r["reason"] for r in read_records(tmp_path / "off" / "rejected.jsonl")] == ["fineweb_quality"]
