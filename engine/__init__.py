"""infermesh's engine: model math, paged KV cache, continuous batching, sampling.

Imports nothing of the services (no grpc, redis or opentelemetry). The public names
below load lazily. What a router needs stays free of torch: the tokenizer
(`engine.tokenizer`), sampling-parameter checks (`engine.sampling_params`), model
config and tokenizer without weights (`engine.model_info`), prefix hashes
(`engine.block_manager`) and the error types (`engine.errors`).
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "engine.llm", "Completion": "engine.llm", "CompletionDelta": "engine.llm",
    "EngineConfig": "engine.core", "EngineCore": "engine.core", "RequestError": "engine.errors",
    "StepOutput": "engine.core", "SamplingParams": "engine.sampling_params",
    "SamplingParamsError": "engine.sampling_params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
