"""Prompt-level semantic context compression with a trace map (issue 17).

Long inputs become "anchors + compressed narrative": structural anchors (headings, numbered clauses,
definitions) are kept verbatim, the narrative is clustered by meaning and chosen by relevance and
diversity to a budget in the serving model's tokens; every kept span cites its document, section,
paragraph, page and character offsets. Code inputs are routed off. Entry point: `compress()`.
"""

from glmserve.compress.compressor import CompressionResult, Document, DocumentReport, Span, compress
from glmserve.compress.policy import PRESETS

__all__ = ["PRESETS", "CompressionResult", "Document", "DocumentReport", "Span", "compress"]
