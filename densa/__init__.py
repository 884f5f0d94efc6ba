"""densa: an LLM inference server that packs more work into the same memory, safely."""

from densa.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # LLM pulls in torch and the model code; keep `import densa` (and the router) light.
    if name == "LLM":
        from densa.engine.llm import LLM

        return LLM
    raise AttributeError(name)
