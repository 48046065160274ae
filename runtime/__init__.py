"""The model runtime: artifacts, backends, the per-process thread context and the engine.

Knows nothing of HTTP. Dependencies point one way: server -> tuner -> runtime, records.
"""
