"""Helpers for tests and benchmarks only: small random models and groups, distribution tests,
lossless checks, the actor -> learner link, the real pipeline as processes, a user's own HF model,
Prometheus scrapes, and (for the vLLM tier only) vLLM engines.

Nothing in actors/, learner/, common/ or ops/ imports this package.
"""
