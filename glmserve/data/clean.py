"""`glmserve data clean`: the layered cleaning pipeline on datatrove's local or Ray executor. Stage 1 reads JSONL or
Parquet and runs the rule filters (mojibake, language, length, Gopher repetition and quality, C4, FineWeb; the
learned quality score may overrule the last four, and drop documents itself when configured); MinHash
near-duplicate removal follows in datatrove's four stages (signatures, buckets, clusters, filter). Every stage
logs its finished tasks, so a rerun on the same DIR skips them. Writes kept.jsonl, rejected.jsonl (`reason` =
the step that removed the record) and report.json."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

from glmserve.data.config import STEPS, load_config
from glmserve.data.executors import StageRunner
from glmserve.data.records import count_records, iter_jsonl, write_records
from glmserve.errors import InvalidRequestError

BADWORDS_SKIPPED = ("C4 bad-words filter skipped: datatrove downloads its word list at run time, and no list "
                    "ships with glmserve")


def _kept_adapter(writer, document) -> dict:
    meta = dict(document.metadata)
    meta.pop("filter_reason", None)
    meta.pop("file_path", None)
    return {"id": document.id, "text": document.text, **meta}


def _rejected_adapter(step: str, writer, document) -> dict:
    meta = dict(document.metadata)
    meta.pop("file_path", None)
    detail = meta.pop("filter_reason", None)
    return {"id": document.id, "text": document.text, **meta, "reason": step, "detail": detail or step}


def _reader(path: Path, progress: bool):
    from datatrove.pipeline.readers import JsonlReader, ParquetReader

    if path.suffix == ".parquet":
        return ParquetReader(str(path.parent), glob_pattern=path.name, recursive=False, doc_progress=progress)
    return JsonlReader(str(path.parent), glob_pattern=path.name, recursive=False, doc_progress=progress,
                       add_file_path=False)


def _writer(folder: Path, name: str, adapter):
    from datatrove.pipeline.writers import JsonlWriter

    return JsonlWriter(str(folder), output_filename=name, compression=None, adapter=adapter)


def _datatrove_filter(step: str, settings: dict[str, Any]):
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )

    from glmserve.data.filters import WORDS

    cls = {"gopher_repetition": GopherRepetitionFilter, "gopher_quality": GopherQualityFilter,
           "c4_quality": C4QualityFilter, "fineweb_quality": FineWebQualityFilter}[step]
    base = {k: v for k, v in settings.items() if k not in ("view", "en", "zh")}
    by_language = {}
    for lang in ("en", "zh"):
        kwargs = {"language": WORDS} | base | settings.get(lang, {})
        try:
            by_language[lang] = cls(**kwargs)
        except TypeError as e:
            raise InvalidRequestError(f"config step {step!r} ({lang}): {e}") from e
    return by_language


def _filter_steps(cfg: dict[str, Any], rejected: Path) -> list:
    from glmserve.data.filters import LanguageIdFilter, LengthFilter, MojibakeFilter, PerLanguageFilter
    from glmserve.data.quality import QUALITY_KEYS, load_model, quality_filter

    quality = cfg["quality"] or {}
    unknown = set(quality) - set(QUALITY_KEYS)
    if unknown:
        raise InvalidRequestError(f"config step 'quality': unknown keys {sorted(unknown)} "
                                  f"(known: {list(QUALITY_KEYS)})")
    if quality:
        load_model(quality.get("model"))  # a bad model path fails here, before any document is read
    steps = []
    for step in STEPS[:-1]:
        settings = cfg[step]
        if settings is False or (step == "quality" and settings.get("min_score") is None):
            continue
        writer = _writer(rejected / step, "${rank}.jsonl", partial(_rejected_adapter, step))
        if step == "mojibake":
            steps.append(MojibakeFilter(**settings, exclusion_writer=writer))
        elif step == "language":
            steps.append(LanguageIdFilter(tuple(cfg["languages"]), **settings, exclusion_writer=writer))
        elif step == "length":
            steps.append(LengthFilter(**settings, exclusion_writer=writer))
        elif step == "quality":
            steps.append(quality_filter(settings["min_score"], settings.get("model"), exclusion_writer=writer))
        else:
            steps.append(PerLanguageFilter(step, _datatrove_filter(step, settings), settings.get("view", "raw"),
                                           rescue_score=quality.get("rescue_score"),
                                           quality_model=quality.get("model"), exclusion_writer=writer))
    return steps


def _minhash(cfg: dict[str, Any], work: Path, rejected: Path, progress: bool, runner: StageRunner) -> None:
    from datatrove.pipeline.dedup.minhash import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )

    from glmserve.data.filters import WORDS
    from glmserve.data.near_dup import minhash_config

    mh = minhash_config(cfg["minhash"])
    filtered, mdir = work / "filtered", work / "minhash"
    runner.run(work / "logs" / "minhash_signatures", [_reader(filtered / "00000.jsonl", False),
                                            MinhashDedupSignature(str(mdir / "signatures"), config=mh,
                                                                                  language=WORDS)])
    # one task per bucket, as datatrove requires (world_size % num_buckets == 0)
    runner.run(work / "logs" / "minhash_buckets", [MinhashDedupBuckets(str(mdir / "signatures"),
                                                                       str(mdir / "buckets"), config=mh)],
               tasks=mh.num_buckets)
    runner.run(work / "logs" / "minhash_clusters", [MinhashDedupCluster(str(mdir / "buckets"),
                                                                        str(mdir / "remove_ids"), config=mh)])
    writer = _writer(rejected / "minhash", "${rank}.jsonl", partial(_rejected_adapter, "minhash"))
    runner.run(work / "logs" / "minhash_filter", [_reader(filtered / "00000.jsonl", progress),
                                        MinhashDedupFilter(str(mdir / "remove_ids"), exclusion_writer=writer),
                                        _writer(work / "kept", "${rank}.jsonl", _kept_adapter)])


def _fresh_work_dir(out: Path, input_path: Path, cfg: dict[str, Any]) -> Path:
    """work/ holds the stages' state; it is reused (resume) only for the same input file, settings and quality
    model file."""
    from glmserve.data.quality import SHIPPED_MODEL

    work = out / "work"
    stat = input_path.stat()
    model = Path((cfg["quality"] or {}).get("model") or SHIPPED_MODEL)
    model_stamp = [model.stat().st_size, model.stat().st_mtime_ns] if cfg["quality"] and model.is_file() else None
    key = hashlib.sha256(json.dumps([str(input_path.resolve()), stat.st_size, stat.st_mtime_ns, cfg, model_stamp],
                                    sort_keys=True, default=str).encode()).hexdigest()
    stamp = work / "run_key"
    if work.exists() and (not stamp.exists() or stamp.read_text() != key):
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    stamp.write_text(key)
    return work


def _parts(folder: Path):
    for part in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        yield from iter_jsonl(part)


def _valid_share(records: list[dict]) -> float | None:
    labels = [r["valid"] for r in records if isinstance(r.get("valid"), bool)]
    return sum(labels) / len(labels) if labels and len(labels) == len(records) else None


def clean(input_path: str | Path, out_dir: str | Path, config: str | Path | None = None,
          output_format: str = "jsonl", progress: bool | None = None, workers: int = 1, executor: str = "local",
          ray_address: str | None = None) -> dict[str, Any]:
    """Runs the pipeline on one JSONL or Parquet file of records with `text` (and `id`); returns the report.
    `workers` > 1 runs MinHash's 14 bucket tasks in a pool of that many processes (local executor); the "ray"
    executor runs every task as a Ray actor, on the cluster at `ray_address` (or a local Ray instance without
    one), and then every machine must see the input and DIR at the same paths (a shared filesystem)."""
    t0 = time.perf_counter()
    input_path, out = Path(input_path), Path(out_dir)
    runner = StageRunner(executor, workers, ray_address)
    if output_format not in ("jsonl", "parquet"):
        raise InvalidRequestError(f"output format must be jsonl or parquet, not {output_format!r}")
    cfg = load_config(config)
    n_in = count_records(input_path)
    progress = sys.stderr.isatty() if progress is None else progress
    out.mkdir(parents=True, exist_ok=True)
    work = _fresh_work_dir(out, input_path, cfg)
    rejected_dir = work / "rejected"
    with runner.connect():
        runner.run(work / "logs" / "filters", [_reader(input_path, progress), *_filter_steps(cfg, rejected_dir),
                                               _writer(work / "filtered", "${rank}.jsonl", _kept_adapter)])
        dedup = cfg["minhash"] is not False and any(True for _ in _parts(work / "filtered"))
        if dedup:
            _minhash(cfg, work, rejected_dir, progress, runner)
    skipped = [{"step": "c4_badwords", "why": BADWORDS_SKIPPED}]
    if dedup:
        kept = list(_parts(work / "kept"))
    else:
        kept = list(_parts(work / "filtered"))
        if cfg["minhash"] is False:
            skipped.append({"step": "minhash", "why": "switched off in the config"})
    print(BADWORDS_SKIPPED, file=sys.stderr)

    steps, rejected, n = [], [], n_in
    for step in STEPS:
        rows = list(_parts(rejected_dir / step))
        if cfg[step] is False:
            continue
        rejected += rows
        steps.append({"step": step, "in": n, "out": n - len(rows), "removed": len(rows),
                      "details": dict(Counter(r["detail"] for r in rows).most_common())})
        n -= len(rows)
    write_records(out / "kept.jsonl", kept)
    write_records(out / "rejected.jsonl", rejected)
    if output_format == "parquet":
        write_records(out / "kept.parquet", kept)
        write_records(out / "rejected.parquet", rejected)
    share = _valid_share(kept)
    report = {
        "input": str(input_path), "records_in": n_in, "records_out": len(kept), "steps": steps,
        "skipped_steps": skipped,
        # documents a rule rejected and the quality model kept (its confidence above quality.rescue_score)
        "rescued_by_quality": dict(Counter(r["rescued"] for r in kept if "rescued" in r).most_common()),
        "estimated_valid_share": share,
        "valid_share_source": "the records' boolean `valid` labels" if share is not None else
        "no `valid` labels in the input records",
        "seconds": round(time.perf_counter() - t0, 3),
    }
    write_records(out / "report.json", report)
    return report
