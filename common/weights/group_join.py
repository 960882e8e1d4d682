"""Joining the weights group (common/weights/collective.py): the run's group secret, kept in Redis
by the sender, and the exchange through the sender's store by which an actor proves it knows it.

A joiner takes a ticket (``joins``, a counter, only to make ticket numbers unique), writes under
``proof/{ticket}`` a fresh nonce of its own and an HMAC of the ticket and the nonce under the
secret, and waits for the sender's answer under ``ticket/{ticket}``: an epoch, a rank and the
group's size, signed (HMAC) for its ticket and nonce. The sender finds proofs by their keys,
never by counting tickets, so tickets taken without a proof (``add("joins", 10**9)``) cost it
nothing and push no joiner out.

The store has no authentication: any process that reaches its port may read, write or delete
any key. A forged answer (a bogus epoch, a refusal) is not signed, so a joiner does not act on
it and waits on for the sender's; what stays possible is denial of service (deleting or
overwriting a joiner's proof or the sender's answer before it is read, or filling the store),
after which the actor takes its versions from Redis.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from datetime import timedelta

import redis
import torch.distributed as dist

from common.weights.collective import CollectiveError

JOINS = "joins"
SECRET_TTL_S = 120
"""The group secret's time to live in Redis; the sender refreshes it every heartbeat, so it goes
away soon after the learner does."""
MAX_PROOFS = 256
"""Joiners' proofs the sender reads per round at most (the others wait for the next round)."""


def group_secret_key(run_id: str) -> str:
    """Where the sender keeps the run's group secret in Redis (actors read it to join)."""
    return f"weights:{run_id}:group_secret"


def new_secret() -> str:
    return secrets.token_hex(32)


def read_secret(client: redis.Redis, run_id: str) -> str:
    """The run's group secret from Redis (``CollectiveError`` where there is none: no sender, or
    it has not written it yet)."""
    try:
        raw = client.get(group_secret_key(run_id))
    except redis.RedisError as e:
        raise CollectiveError(f"cannot read the weights group's secret from Redis: {e}") from e
    if not raw:
        raise CollectiveError("no weights group secret in Redis (no sender for this run)")
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _mac(secret: str, message: str) -> str:
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()


def join_proof(secret: str, run_id: str, ticket: int, nonce: str) -> str:
    """An HMAC of a joiner's ticket and its own nonce under the secret."""
    return _mac(secret, f"specrl-weights-group/join/{run_id}/{ticket}/{nonce}")


def new_join_proof(secret: str, run_id: str, ticket: int) -> tuple[str, str]:
    """A joiner's fresh nonce, and what it writes under ``proof/{ticket}``: the nonce and
    :func:`join_proof` of both. The sender signs its answer for that nonce."""
    nonce = secrets.token_hex(16)
    return nonce, f"{nonce}.{join_proof(secret, run_id, ticket, nonce)}"


def _text(raw: bytes | str | None) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw or "")


def proven_nonce(secret: str, run_id: str, ticket: int, proof: bytes | str | None) -> str | None:
    """The joiner's nonce when ``proof`` (under ``proof/{ticket}``) is right, else None
    (compared in constant time)."""
    nonce, _, mac = _text(proof).partition(".")
    if re.fullmatch(r"[0-9a-f]{32}", nonce) is None:
        return None
    return nonce if hmac.compare_digest(mac, join_proof(secret, run_id, ticket, nonce)) else None


def _answer_mac(secret: str, run_id: str, ticket: int, nonce: str, body: str) -> str:
    return _mac(secret, f"specrl-weights-group/answer/{run_id}/{ticket}/{nonce}/{body}")


def signed_answer(secret: str, run_id: str, ticket: int, nonce: str, answer: dict) -> str:
    """The sender's answer to a proven ticket (under ``ticket/{ticket}``), signed for the
    joiner's nonce: another process of the host can write the store, not sign."""
    body = json.dumps(answer, sort_keys=True)
    return json.dumps({"answer": body, "mac": _answer_mac(secret, run_id, ticket, nonce, body)})


def verified_answer(
    secret: str, run_id: str, ticket: int, nonce: str, raw: bytes | str | None
) -> dict | None:
    """The answer in ``raw`` if the sender signed it for this ticket and nonce, else None."""
    try:
        outer = json.loads(_text(raw))
        body, mac = str(outer["answer"]), str(outer["mac"])
    except (ValueError, KeyError, TypeError):
        return None
    if not hmac.compare_digest(mac, _answer_mac(secret, run_id, ticket, nonce, body)):
        return None
    answer = json.loads(body)
    return answer if isinstance(answer, dict) else None


def await_answer(
    store: dist.Store, secret: str, run_id: str, ticket: int, nonce: str, timeout_s: float
) -> dict:
    """The sender's signed answer to ``ticket`` (:func:`signed_answer`). The store has no
    authentication: an answer another process wrote there (a bogus epoch, a refusal) is not
    acted on, and the wait goes on until ``timeout_s`` (``CollectiveError`` then, with what the
    unsigned answer said: the sender's refusals are unsigned too)."""
    key = f"ticket/{ticket}"
    deadline = time.monotonic() + timeout_s
    unsigned = b""
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            store.wait([key], timedelta(seconds=remaining))
        except RuntimeError:  # DistStoreError: timed out
            break
        raw = store.get(key)
        answer = verified_answer(secret, run_id, ticket, nonce, raw)
        if answer is not None:
            return answer
        unsigned = raw
        time.sleep(0.05)
    said = f"; an unsigned answer says {_text(unsigned)[:200]}" if unsigned else ""
    raise CollectiveError(f"no signed answer to ticket {ticket} in {timeout_s:g} s{said}")
