"""The vector store: Milvus through `pymilvus` (extra `glmserve[rag]`). The embedded default is Milvus Lite, a
local `.db` path (milvus-lite 3.x: a pure-Python engine with FAISS indexes, started in-process behind a
loopback gRPC port; the path is its data directory); a Milvus server URL (`http://host:19530`) serves at
scale with the same code. One collection per index; each row is a record (glmserve/compress/rag/records.py)
with its vector, source range, text and trace map (JSON), searched by inner product (vectors are unit). An index
of parent sections has a second collection, `<name>_keys`: one row per key (a summary sentence or anchor of a
section) with its own vector, its text with Milvus' BM25 function (a sparse vector the server derives from the
text), and the id of its record, so that a search grouped by record scores each section by its best key (max-sim,
the "parent document" pattern).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from glmserve.compress.rag.records import Record, SpanRef
from glmserve.compress.rag.vectors import DIM
from glmserve.errors import GlmServeError, InvalidRequestError

TEXT_BYTES = 65_535  # Milvus VARCHAR limit
INSERT_BATCH = 256
# Milvus Lite's in-process gRPC server keeps grpc's default ping policy (at most one ping per 5 minutes without
# data, GOAWAY "too_many_pings" after that, and the channel never recovers); pymilvus pings every 10 s even when
# idle, so a client that waits minutes between calls (building an index) is cut off. Local stores ping rarely.
LITE_GRPC_OPTIONS = {"grpc.keepalive_time_ms": 600_000, "grpc.keepalive_permit_without_calls": 0}


class VectorStoreError(GlmServeError):
    """The Milvus store cannot be opened or answered an operation with an error."""


def _client(uri: str, token: str | None) -> Any:
    if not (uri.endswith(".db") or uri.startswith(("http://", "https://", "tcp://", "unix:"))):
        raise InvalidRequestError(f"a Milvus URI is a local path ending in .db (Milvus Lite) or a server URL "
                                  f"(http://host:19530), got {uri!r}")
    try:
        from pymilvus import MilvusClient
    except ImportError as exc:
        raise InvalidRequestError("RAG on Milvus needs pymilvus and milvus-lite: pip install 'glmserve[rag]'") from exc
    try:
        extra = {"grpc_options": LITE_GRPC_OPTIONS} if uri.endswith(".db") else {}
        return MilvusClient(uri=uri, token=token or "", timeout=30, **extra)
    except Exception as exc:  # pymilvus raises MilvusException and grpc errors
        raise VectorStoreError(f"cannot open Milvus at {uri}: {exc}") from exc


class MilvusStore:
    """One collection of records in Milvus (Lite or a server)."""

    def __init__(self, uri: str, collection: str, token: str | None = None) -> None:
        self.uri = uri
        self.collection = collection
        self.client = _client(uri, token)

    def create(self, replace: bool = True) -> None:
        from pymilvus import DataType, MilvusClient

        if self.client.has_collection(self.collection):
            if not replace:
                return
            self.client.drop_collection(self.collection)
        schema = MilvusClient.create_schema(auto_id=False)
        schema.add_field("id", DataType.INT64, is_primary=True)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=DIM)
        schema.add_field("doc", DataType.VARCHAR, max_length=1024)
        schema.add_field("section", DataType.VARCHAR, max_length=512)
        schema.add_field("start", DataType.INT64)
        schema.add_field("end", DataType.INT64)
        schema.add_field("text", DataType.VARCHAR, max_length=TEXT_BYTES)
        schema.add_field("spans", DataType.JSON)
        index = self.client.prepare_index_params()
        index.add_index(field_name="vector", index_type="FLAT", metric_type="IP")
        self.client.create_collection(self.collection, schema=schema, index_params=index)

    @property
    def keys_collection(self) -> str:
        return f"{self.collection}_keys"

    def has_keys(self) -> bool:
        return bool(self.client.has_collection(self.keys_collection))

    def create_keys(self) -> None:
        """(Re)creates the keys collection of this index."""
        from pymilvus import DataType, Function, FunctionType, MilvusClient

        if self.has_keys():
            self.client.drop_collection(self.keys_collection)
        schema = MilvusClient.create_schema(auto_id=False)
        schema.add_field("id", DataType.INT64, is_primary=True)
        schema.add_field("record", DataType.INT64)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=DIM)
        schema.add_field("text", DataType.VARCHAR, max_length=TEXT_BYTES, enable_analyzer=True)
        schema.add_field("sparse", DataType.SPARSE_FLOAT_VECTOR)
        schema.add_function(Function(name="text_bm25", function_type=FunctionType.BM25, input_field_names=["text"],
                                     output_field_names=["sparse"]))
        index = self.client.prepare_index_params()
        index.add_index(field_name="vector", index_type="FLAT", metric_type="IP")
        index.add_index(field_name="sparse", index_type="SPARSE_INVERTED_INDEX", metric_type="BM25")
        self.client.create_collection(self.keys_collection, schema=schema, index_params=index)

    def insert_keys(self, records: Sequence[int], texts: Sequence[str], vectors: np.ndarray) -> None:
        """Keys: the id of the record each points to, its text and its vector."""
        if not len(records) == len(texts) == len(vectors):
            raise InvalidRequestError(f"{len(records)} record ids, {len(texts)} texts, {len(vectors)} vectors")
        rows = [{"id": i, "record": int(r), "vector": v.astype(np.float32).tolist(), "text": t}
                for i, (r, t, v) in enumerate(zip(records, texts, vectors))]
        self._insert(self.keys_collection, rows)

    def search_keys(self, queries: np.ndarray | Sequence[str], k: int, field: str) -> list[list[int]]:
        """Per query, the ids of the k records whose best key matches it best, best first: `field` "vector"
        (queries are vectors, inner product) or "sparse" (queries are texts, BM25); a search grouped by record."""
        data = _vector_data(queries) if field == "vector" else list(queries)
        hits = self._search(self.keys_collection, data, k, field, ["record"], group_by="record")
        return [[int(h["entity"]["record"]) for h in per_query] for per_query in hits]

    def records_with(self, term: str, limit: int = 64) -> list[int]:
        """Ids of the records with a key whose text contains `term` exactly (a Milvus `like` filter; `_` in a term
        matches any one character there, which only widens the match)."""
        if not term or any(c in term for c in '"\\%'):
            raise InvalidRequestError(f"an exact-match term is non-empty, without quotes, backslashes or %: {term!r}")
        self._require(self.keys_collection)
        try:
            self.client.load_collection(self.keys_collection)
            rows = self.client.query(self.keys_collection, filter=f'text like "%{term}%"', output_fields=["record"],
                                     limit=limit)
        except Exception as exc:
            raise VectorStoreError(f"Milvus query in {self.keys_collection} failed: {exc}") from exc
        return list(dict.fromkeys(int(r["record"]) for r in rows))

    def get(self, ids: Sequence[int]) -> list[Record]:
        """The records with these ids, in the order given."""
        if not ids:
            return []
        self._require(self.collection)
        try:
            self.client.load_collection(self.collection)
            rows = self.client.get(self.collection, ids=[int(i) for i in ids],
                                   output_fields=["doc", "section", "start", "end", "text", "spans"])
        except Exception as exc:
            raise VectorStoreError(f"Milvus get from {self.collection} failed: {exc}") from exc
        by_id = {int(r["id"]): _record(r) for r in rows}
        return [by_id[int(i)] for i in ids if int(i) in by_id]

    def _require(self, collection: str) -> None:
        if not self.client.has_collection(collection):
            raise InvalidRequestError(f"no index {collection!r} in {self.uri}: build it with `glmserve rag index`")

    def _insert(self, collection: str, rows: list[dict]) -> None:
        try:
            for i in range(0, len(rows), INSERT_BATCH):
                self.client.insert(collection, rows[i:i + INSERT_BATCH])
            self.client.flush(collection)
        except Exception as exc:
            raise VectorStoreError(f"Milvus insert into {collection} failed: {exc}") from exc

    def insert(self, records: Sequence[Record], vectors: np.ndarray, first_id: int = 0) -> None:
        if len(records) != len(vectors):
            raise InvalidRequestError(f"{len(records)} records but {len(vectors)} vectors")
        rows = []
        for i, (r, v) in enumerate(zip(records, vectors)):
            if len(r.text.encode("utf-8")) > TEXT_BYTES:
                raise InvalidRequestError(f"record {r.doc} §{r.section} has more than {TEXT_BYTES} bytes of text")
            rows.append({"id": first_id + i, "vector": v.astype(np.float32).tolist(), "doc": r.doc[:1024],
                         "section": r.section[:512], "start": r.start, "end": r.end, "text": r.text,
                         "spans": [asdict(s) for s in r.spans]})
        self._insert(self.collection, rows)

    def search_ids(self, vectors: np.ndarray, k: int) -> list[list[int]]:
        """The ids of the k records nearest each query vector, best first."""
        return [[int(h["id"]) for h in per_query] for per_query in self._search(self.collection,
                                                                                 _vector_data(vectors), k, "vector")]

    def _search(self, collection: str, data: list, k: int, field: str, output_fields: list[str] | None = None,
                group_by: str | None = None) -> list[list[dict]]:
        self._require(collection)
        extra = {"group_by_field": group_by} if group_by else {}
        try:
            self.client.load_collection(collection)
            return self.client.search(collection, data=data, limit=k, anns_field=field,
                                      output_fields=output_fields or [], **extra)
        except Exception as exc:
            raise VectorStoreError(f"Milvus search in {collection} failed: {exc}") from exc

    def count(self) -> int:
        return int(self.client.get_collection_stats(self.collection)["row_count"])

    def close(self) -> None:
        self.client.close()


def _vector_data(vectors: np.ndarray) -> list[list[float]]:
    return [v.astype(np.float32).tolist() for v in vectors]


def _record(entity: dict) -> Record:
    spans = entity["spans"]
    if isinstance(spans, str):
        spans = json.loads(spans)
    return Record(entity["doc"], entity["section"], int(entity["start"]), int(entity["end"]), entity["text"],
                  [SpanRef(**s) for s in spans])
