"""The vector store: Milvus through `pymilvus` (extra `glmserve[rag]`). The embedded default is Milvus Lite, a
local `.db` path (milvus-lite 3.x: a pure-Python engine with FAISS indexes, started in-process behind a
loopback gRPC port; the path is its data directory); a Milvus server URL (`http://host:19530`) serves at
scale with the same code. One collection per index; each row is a record (glmserve/compress/rag/records.py)
with its vector, source range, text and trace map (JSON), searched by inner product (vectors are unit).
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
        try:
            for i in range(0, len(rows), INSERT_BATCH):
                self.client.insert(self.collection, rows[i:i + INSERT_BATCH])
            self.client.flush(self.collection)
        except Exception as exc:
            raise VectorStoreError(f"Milvus insert into {self.collection} failed: {exc}") from exc

    def search(self, vectors: np.ndarray, k: int) -> list[list[tuple[float, Record]]]:
        """The k best records of each query vector, best first, with their scores."""
        if not self.client.has_collection(self.collection):
            raise InvalidRequestError(f"no index {self.collection!r} in {self.uri}: build it with `glmserve rag index`")
        try:
            self.client.load_collection(self.collection)
            hits = self.client.search(self.collection, data=[v.astype(np.float32).tolist() for v in vectors],
                                      limit=k, anns_field="vector",
                                      output_fields=["doc", "section", "start", "end", "text", "spans"])
        except Exception as exc:
            raise VectorStoreError(f"Milvus search in {self.collection} failed: {exc}") from exc
        return [[(float(h["distance"]), _record(h["entity"])) for h in per_query] for per_query in hits]

    def count(self) -> int:
        return int(self.client.get_collection_stats(self.collection)["row_count"])

    def close(self) -> None:
        self.client.close()


def _record(entity: dict) -> Record:
    spans = entity["spans"]
    if isinstance(spans, str):
        spans = json.loads(spans)
    return Record(entity["doc"], entity["section"], int(entity["start"]), int(entity["end"]), entity["text"],
                  [SpanRef(**s) for s in spans])
