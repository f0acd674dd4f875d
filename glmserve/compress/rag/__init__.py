"""RAG on compressed summaries (issue 17's third application): each document section is compressed
(glmserve/compress: anchors verbatim, narrative to a ratio), embedded with the compressor's sentence encoder and
stored in Milvus with its trace map; a question retrieves the top-5 sections and quotes their best spans at
exact source offsets. Milvus Lite (a local `.db` path) is the embedded default, a Milvus server URL the option
for scale; plain fixed-size chunking in the same store is the baseline (bench/bench_rag.py).
Command line: `glmserve rag index FILE... | rag query QUESTION` (glmserve/compress/rag/cli.py).
"""

from glmserve.compress.rag.index import Hit, Quote, build_index, make_records, query
from glmserve.compress.rag.records import Record, SpanRef
from glmserve.compress.rag.store import MilvusStore, VectorStoreError

__all__ = ["Hit", "MilvusStore", "Quote", "Record", "SpanRef", "VectorStoreError", "build_index", "make_records",
           "query"]
