"""`glmserve rag index FILE... [--mode sections|summary|chunks] [--db PATH | --milvus-uri URI]` and `glmserve rag
query QUESTION`: RAG on compressed section summaries in Milvus (glmserve/cli.py delegates here). By default a
query retrieves sections by their keys (glmserve/compress/rag/retrieve.py's DEFAULT_METHOD) and hands over the top
sections compressed for the question to a token budget, each kept span cited at its source offsets."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from glmserve.errors import InvalidRequestError

SUMMARY_RATIO = 3.4  # --mode summary's default ratio


def _store(args: argparse.Namespace):
    from glmserve.compress.rag import MilvusStore

    return MilvusStore(args.milvus_uri or args.db, args.collection, args.milvus_token)


def _cmd_index(args: argparse.Namespace) -> None:
    from glmserve.compress import Document
    from glmserve.compress.rag import build_index, make_parents, make_records
    from glmserve.compress.rag.index import KEY_RATIO

    docs = []
    for name in args.files:
        try:
            docs.append(Document(name, Path(name).read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(f"cannot read {name}: {exc}") from exc
    keys: list = []
    if args.mode == "sections":
        ratio = KEY_RATIO if args.ratio is None else args.ratio
        records, keys = make_parents(docs, ratio)
    else:
        ratio = SUMMARY_RATIO if args.ratio is None else args.ratio
        records = make_records(docs, args.mode, ratio, args.chunk_words)
    store = _store(args)
    try:
        n = build_index(store, records, keys)
    finally:
        store.close()
    print(json.dumps({"collection": args.collection, "uri": args.milvus_uri or args.db, "mode": args.mode,
                      "records": n, "keys": len(keys), "documents": len(docs)}))


def _method(args: argparse.Namespace, store) -> str:
    from glmserve.compress.rag import DEFAULT_METHOD

    if args.retrieve != "auto":
        return args.retrieve
    return DEFAULT_METHOD if store.has_keys() else "mean"


def _cmd_query(args: argparse.Namespace) -> None:
    from glmserve.compress.rag import ask, query
    from glmserve.compress.rag.index import READ_TOKENS

    store = _store(args)
    try:
        method = _method(args, store)
        if args.read == "compressed":
            tokens = READ_TOKENS if args.target_tokens is None else args.target_tokens
            answer = ask(store, args.question, args.top_k, tokens, method)
        else:
            hits = query(store, args.question, args.top_k, method)
    finally:
        store.close()
    if args.read == "compressed":
        _print_answer(answer, method, args.json)
    else:
        _print_hits(hits, method, args.json)


def _print_answer(answer, method: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"retrieval": method, "text": answer.text, "tokens": answer.tokens,
                          "sections": [{"doc": r.doc, "section": r.section, "start": r.start, "end": r.end}
                                       for r in answer.sections],
                          "quotes": [asdict(q) for q in answer.quotes]}, ensure_ascii=False, indent=1))
        return
    print(f"{answer.tokens} tokens from {len(answer.sections)} sections ({method}):")
    for q in answer.quotes:
        print(f"  {q.doc} §{q.section} ¶{q.paragraph} p.{q.page} @{q.start}-{q.end}: {q.text[:160]}")


def _print_hits(hits, method: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps([{"retrieval": method, "score": h.score, "doc": h.record.doc, "section": h.record.section,
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
    index = rag_sub.add_parser("index", help="store each section with its trace map and its summary's keys")
    index.add_argument("files", nargs="+", metavar="FILE")
    index.add_argument("--mode", choices=["sections", "summary", "chunks"], default="sections",
                       help="whole sections keyed by their summary sentences and anchors (default), one vector per "
                            "section summary, or plain fixed-size chunks (the baseline)")
    index.add_argument("--ratio", type=float, default=None,
                       help="summary ratio: of the keys in --mode sections (default: every sentence a key), of the "
                            f"stored summaries in --mode summary (default {SUMMARY_RATIO}; 1: sections whole)")
    index.add_argument("--chunk-words", type=int, default=128, help="words a chunk in --mode chunks")
    _add_store_args(index)
    index.set_defaults(handler=_cmd_index)
    q = rag_sub.add_parser("query", help="the top sections for a question, compressed for it, at source offsets")
    q.add_argument("question")
    q.add_argument("--top-k", type=int, default=5, help="sections (or records) retrieved")
    q.add_argument("--retrieve", default="auto",
                   help="'auto' (on an index with keys the method chosen on the benchmark's tune split, "
                        "retrieve.DEFAULT_METHOD; else mean) or a '+'-joined set of mean, maxsim, bm25, anchors")
    q.add_argument("--read", choices=["compressed", "quotes"], default="compressed",
                   help="the top sections compressed together for the question (default), or each record's best "
                        "spans (the earlier output)")
    q.add_argument("--target-tokens", type=int, default=None,
                   help="tokens handed over with --read compressed (default: glmserve/compress/rag/index.py's "
                        "READ_TOKENS, 2048, about what 5 chunks of 256 words hand over)")
    q.add_argument("--json", action="store_true")
    _add_store_args(q)
    q.set_defaults(handler=_cmd_query)
