"""`glmserve rag index FILE... [--db PATH | --milvus-uri URI]` and `glmserve rag query QUESTION`: RAG on compressed
section summaries in Milvus (glmserve/cli.py delegates here)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from glmserve.errors import InvalidRequestError


def _store(args: argparse.Namespace):
    from glmserve.compress.rag import MilvusStore

    return MilvusStore(args.milvus_uri or args.db, args.collection, args.milvus_token)


def _cmd_index(args: argparse.Namespace) -> None:
    from glmserve.compress import Document
    from glmserve.compress.rag import build_index, make_records

    docs = []
    for name in args.files:
        try:
            docs.append(Document(name, Path(name).read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(f"cannot read {name}: {exc}") from exc
    records = make_records(docs, args.mode, args.ratio, args.chunk_words)
    store = _store(args)
    try:
        n = build_index(store, records)
    finally:
        store.close()
    print(json.dumps({"collection": args.collection, "uri": args.milvus_uri or args.db, "mode": args.mode,
                      "records": n, "documents": len(docs)}))


def _cmd_query(args: argparse.Namespace) -> None:
    from glmserve.compress.rag import query

    store = _store(args)
    try:
        hits = query(store, args.question, args.top_k)
    finally:
        store.close()
    if args.json:
        print(json.dumps([{"score": h.score, "doc": h.record.doc, "section": h.record.section,
                           "start": h.record.start, "end": h.record.end, "quotes": [asdict(q) for q in h.quotes]}
                          for h in hits], ensure_ascii=False, indent=1))
        return
    for rank, h in enumerate(hits, 1):
        print(f"{rank}. {h.record.doc} §{h.record.section} ({h.score:.3f})")
        for q in h.quotes:
            print(f"   ¶{q.paragraph} @{q.start}-{q.end}: {q.text[:160]}")


def _add_store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default="rag.db", help="Milvus Lite database (a local path ending in .db; default rag.db)")
    p.add_argument("--milvus-uri", default=None, metavar="URI",
                   help="a Milvus server instead of Milvus Lite, e.g. http://127.0.0.1:19530")
    p.add_argument("--milvus-token", default=None, help="the server's token (user:password), if it needs one")
    p.add_argument("--collection", default="sections", help="the index's collection name")


def add_rag_parser(sub: argparse._SubParsersAction) -> None:
    rag = sub.add_parser("rag", help="RAG on compressed section summaries stored in Milvus (Lite by default)")
    rag_sub = rag.add_subparsers(dest="rag_command", required=True)
    index = rag_sub.add_parser("index", help="compress each section, embed it, store it with its trace map")
    index.add_argument("files", nargs="+", metavar="FILE")
    index.add_argument("--mode", choices=["summary", "chunks"], default="summary",
                       help="section summaries (default) or plain fixed-size chunks (the baseline)")
    index.add_argument("--ratio", type=float, default=3.4, help="summary compression ratio (1: sections whole)")
    index.add_argument("--chunk-words", type=int, default=128, help="words a chunk in --mode chunks")
    _add_store_args(index)
    index.set_defaults(handler=_cmd_index)
    q = rag_sub.add_parser("query", help="the top-k sections for a question, their best spans at source offsets")
    q.add_argument("question")
    q.add_argument("--top-k", type=int, default=5)
    q.add_argument("--json", action="store_true")
    _add_store_args(q)
    q.set_defaults(handler=_cmd_query)
