"""Rewards written as code (``task.reward=<module or file>:<function>``), run in worker processes:
the spec and its loading (:mod:`.spec`), the worker (:mod:`.worker`), the bounded pool with its
per-call timeout and optional sandbox (:mod:`.pool`), and the actor's scorers (:mod:`.scoring`).
"""
