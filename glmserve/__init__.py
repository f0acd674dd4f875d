"""glmserve: a Python-first inference and serving stack for long-context LLMs."""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy so that `import glmserve` stays cheap: the gateway and the CLI's parser never import torch, and the CLI
    # imports it only when a command that needs the engine runs.
    if name == "LLM":
        from glmserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from glmserve.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
