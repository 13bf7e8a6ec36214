"""infermesh's engine: model math, paged KV cache, continuous batching, sampling.

Imports nothing of the services (no grpc, redis or opentelemetry). The public names
below load lazily, so `import engine.tokenizer` (the router's only need) stays
free of torch.
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "engine.llm", "Completion": "engine.llm", "CompletionDelta": "engine.llm",
    "EngineConfig": "engine.core", "EngineCore": "engine.core", "RequestError": "engine.core",
    "StepOutput": "engine.core", "SamplingParams": "engine.sampler", "SamplingParamsError": "engine.sampler",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
