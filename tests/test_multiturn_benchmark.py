"""benchmarks/multiturn_rows.py and benchmarks/multiturn_chaos.py on a random tiny char model
(what they count does not need a trained one): no environment position reaches the learner's
loss, no turn request re-tokenises, the chat bridge probe passes, and each injected fault, through
real worker processes, ends only its own episode with the outcome the design's table gives."""

from __future__ import annotations

import threading
import time
import types

import pytest

from benchmarks import multiturn_chaos, multiturn_rows
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from testing.models import random_model

pytestmark = pytest.mark.integration

TOKENIZER = CharTokenizer(BUILTIN_ALPHABET)


@pytest.fixture(scope="module")
def setup():
    cfg = multiturn_rows.lookup_config()
    return random_model(TOKENIZER.vocab_size, seed=1), TOKENIZER, cfg


def test_mechanics_rows_count_what_must_be_zero(setup):
    model, tokenizer, cfg = setup
    out = multiturn_rows.mechanics_figures(model, tokenizer, cfg, batches=2, conversations=20)
    assert out["mt_env_tokens_collated"] > 0  # environment tokens were there to leak
    assert out["mt_env_positions_in_loss"] == 0
    assert out["mt_turn_requests_checked"] >= out["mt_mechanics_episodes"]
    assert out["mt_retokenization_mismatches"] == 0
    assert out["mt_bridge_probe_mismatches"] == 0
    assert out["mt_ngram_tokens_per_verify_other_turns"] >= 1.0


def test_each_injected_fault_ends_only_its_episode(setup):
    model, tokenizer, cfg = setup
    counts = {"crash": 2, "hang": 1, "huge": 2, "huge_mib": 1, "malformed": 3}
    result = multiturn_chaos.run_chaos(model, tokenizer, cfg, workers=2, counts=counts)
    rows = multiturn_chaos.rows(result, workers=2)
    crash, hang = rows["mt_chaos_env_crash"], rows["mt_chaos_env_hang"]
    assert crash["groups_dropped"] == 2 and crash["stops"] == {"env_error": 2}
    assert hang["timed_out"] == 1
    assert hang["max_step_wall_s"] <= hang["step_timeout_s"] + 2
    assert hang["decode_thread_longest_handoff_s"] < hang["step_timeout_s"]
    assert hang["decode_blocked_on_env_s"] == 0.0
    huge = rows["mt_chaos_huge_obs"]
    assert huge["truncated"] == 2 and huge["refused_env_error"] == 1
    assert huge["max_episode_tokens"] <= huge["max_total_tokens"]
    malformed = rows["mt_chaos_malformed_tool_call"]
    assert malformed["error_observations"] == malformed["episodes_continued"] == 3
    assert malformed["env_errors"] == 0
    # Nothing else failed: the other sessions of a replaced worker were replayed.
    assert rows["mt_chaos_collateral"] == {"sibling_failures": 0, "clean_groups_dropped": 0}
    assert rows["mt_chaos_env_pool"]["replays_failed"] == 0


def test_calls_on_the_decode_thread_are_timed_and_others_are_not():
    class Sleepy:
        def step(self, action):
            time.sleep(0.05)
            return action

    wrapped = types.SimpleNamespace(decode_threads={threading.get_ident()})
    blocked = [0.0]
    env = multiturn_chaos.OnDecodeThread(Sleepy(), wrapped, blocked)
    elsewhere = threading.Thread(target=env.step, args=("a",))
    elsewhere.start()
    elsewhere.join()
    assert blocked == [0.0]
    assert env.step("b") == "b" and blocked[0] >= 0.05  # on the "decode" thread: counted


def test_forged_special_tokens_stay_text():
    out = multiturn_chaos.forged_special_tokens()
    assert out["injected"] > 0 and out["forged_boundaries"] == 0
