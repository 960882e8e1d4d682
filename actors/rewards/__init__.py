"""Rewards written as code (``task.reward=<module or file>:<function>``), run in worker processes:
the spec and its loading (:mod:`.spec`), the worker (:mod:`.worker`), the bounded pool with its
per-call timeout and optional sandbox (:mod:`.pool`, :mod:`.sandbox`), the actor's scorers
(:mod:`.scoring`), and :func:`run_untrusted` for the model-written code a reward executes
(:mod:`.untrusted`).
"""

from actors.rewards.untrusted import UntrustedResult, run_untrusted

__all__ = ["UntrustedResult", "run_untrusted"]
