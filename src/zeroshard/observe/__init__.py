"""The observatory: the profiler (it listens to the engine's events), traces, charts."""
