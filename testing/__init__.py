"""Helpers for tests and benchmarks only: small random models, distribution tests, lossless checks.

Nothing in actors/, learner/, common/ or ops/ imports this package.
"""
