"""RAG on compressed summaries (issue 17's third application). The default index stores each document section
whole as a parent record with its trace map, and its summary's sentences and anchors (glmserve/compress) as keys,
each with a vector of its own and its words for BM25, in Milvus; a question ranks sections by their best keys (BM25
by default; dense max-sim, exact anchors and their fusion by reciprocal rank as options), and the top sections are
compressed together for the question to the reader's token budget, every kept span at exact source offsets
(retrieve-then-compress). The earlier designs stay: one vector per compressed section summary, and plain
fixed-size chunking, the baseline (bench/bench_rag.py). Milvus Lite (a local `.db` path) is the embedded default, a
Milvus server URL the option for scale. Command line: `glmserve rag index FILE... | rag query QUESTION`
(glmserve/compress/rag/cli.py).
"""

from glmserve.compress.rag.index import Hit, ask, build_index, make_parents, make_records, query
from glmserve.compress.rag.read import Answer, read
from glmserve.compress.rag.records import Quote, Record, SpanRef
from glmserve.compress.rag.retrieve import DEFAULT_METHOD, rank
from glmserve.compress.rag.store import MilvusStore, VectorStoreError

__all__ = ["DEFAULT_METHOD", "Answer", "Hit", "MilvusStore", "Quote", "Record", "SpanRef", "VectorStoreError", "ask",
           "build_index", "make_parents", "make_records", "query", "rank", "read"]
