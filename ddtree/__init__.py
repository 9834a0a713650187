"""ddtree: DDTree speculative decoding with a DFlash drafter, lossless, behind an OpenAI-compatible server."""
from ddtree.config import DDTreeError, SamplingParams, parse_tree_budget

__version__ = "0.1.0"


def __getattr__(name):
    # The API pulls in torch and the models: import it only when asked for.
    if name in ("LLM", "GenerationResult", "StreamEvent"):
        from ddtree import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'ddtree' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "DDTreeError", "parse_tree_budget", "__version__"]
