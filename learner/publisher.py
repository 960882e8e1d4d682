"""Publishes the learner's policy as a new weights version in Redis."""

from __future__ import annotations

import logging
import time

from common.model import Transformer
from common.policy_meta import policy_meta
from common.tokenizer import Tokenizer
from common.weights import WeightStore

log = logging.getLogger(__name__)


class Publisher:
    def __init__(self, store: WeightStore, model: Transformer, tokenizer: Tokenizer) -> None:
        self.store = store
        self.model = model
        self.meta = policy_meta(model.args, tokenizer)
        self.last_publish_s = 0.0

    def publish(self, version: int) -> None:
        started = time.perf_counter()
        state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        self.store.publish(version, state, meta=self.meta)
        self.last_publish_s = time.perf_counter() - started
        log.debug("published version %d in %.3fs", version, self.last_publish_s)
