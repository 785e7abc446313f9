"""BladeLLM: an LLM inference and serving engine."""

from bladellm.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Engine classes pull in torch and transformers; import them only when asked for.
    if name == "LLM":
        from bladellm.engine.llm_engine import LLM
        return LLM
    if name == "AsyncLLM":
        from bladellm.engine.async_llm import AsyncLLM
        return AsyncLLM
    raise AttributeError(name)
