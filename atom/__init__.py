"""ATOM: an LLM inference engine for hybrid linear-attention and dense models."""

from atom.outputs import CompletionOutput, RequestOutput
from atom.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Heavy front ends load on first use, so `import atom` stays cheap.
    if name == "LLM":
        from atom.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from atom.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
