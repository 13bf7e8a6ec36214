"""Moving a request's KV cache from prefill ranks to decode ranks: plans (pure) and transports."""
