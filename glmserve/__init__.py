"""glmserve: a Python-first inference and serving stack for long-context LLMs."""

from glmserve.engine.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy so that `import glmserve` stays cheap (the CLI imports torch only when it runs).
    if name == "LLM":
        from glmserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
