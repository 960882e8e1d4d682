"""Every metric key specrl writes to its metrics files and reads back, defined once.

Writers (the actor loop, the engines, the sender, the learner, the receiver) and readers (the
Prometheus exporters, the launcher's progress line, reports, benchmarks) use these names, never
the strings. A key is ``<side>/<name>``; a ``*_PREFIX`` name starts a family of keys with a
suffix (a reason, a position).
"""

from __future__ import annotations

# The two groups of per-batch rollout figures an engine reports; both sides pass them through.
SPEC_GROUP = "spec/"
VERIFY_GROUP = "verify/"
# A user reward's figures per group (actors/rewards/scoring.py): its components' means
# (``reward/<name>``) and the calls that gave no reward (``reward/failed``, ``..._<kind>``).
REWARD_PREFIX = "reward/"
REWARD_FAILED = "reward/failed"
# An episode's figures per group (actors/episodes/runner.py): ``env/turns_mean``,
# ``env/token_frac`` (below).
ENV_GROUP = "env/"
ROLLOUT_GROUPS = (SPEC_GROUP, VERIFY_GROUP, REWARD_PREFIX, ENV_GROUP)

# Evaluation on held-out problems during training (actors/evaluation.py): an actor's figures of
# the version it evaluated, passed on by the learner in the step record after they arrive.
EVAL_PREFIX = "eval/"
EVAL_VERSION = "eval/version"
EVAL_AVG_REWARD = "eval/avg_reward"
EVAL_PASS_AT_1 = "eval/pass_at_1"
EVAL_PASS_AT_K = "eval/pass_at_k"
EVAL_K = "eval/k"
EVAL_PROMPTS = "eval/prompts"
EVAL_S = "eval/s"
EVAL_REWARD_FAILED = "eval/reward_failed"
EVAL_GREEDY_AVG_REWARD = "eval/greedy_avg_reward"
EVAL_GREEDY_PASS = "eval/greedy_pass"

# Actor loop: one record per generated batch.
ACTOR_BATCHES = "actor/batches"
ACTOR_FORWARD_PASSES = "actor/forward_passes"
ACTOR_GENERATE_S = "actor/generate_s"
ACTOR_GEN_TIME_S = "actor/gen_time_s"
ACTOR_GROUPS_SENT = "actor/groups_sent"
ACTOR_LIVE = "actor/live"
ACTOR_REWARD_MEAN = "actor/reward_mean"
ACTOR_REWARD_FAILURES = "actor/reward_failures"
ACTOR_REWARD_GROUPS_DROPPED = "actor/reward_groups_dropped"
ACTOR_TOKENS = "actor/tokens"
ACTOR_TOKENS_PER_S = "actor/tokens_per_s"
ACTOR_WAIT_S = "actor/wait_s"
ACTOR_WEIGHT_FETCH_S = "actor/weight_fetch_s"
# The weight feed (common/weights/fetch/feed.py): decode-loop time blocked on weights while a version
# is being delivered (taking it from the feed, and the engine loading it, in-flight verification
# included), the loop's time during deliveries, their ratio; the engine's load seconds of all
# versions taken (the load share of the stall, and loads outside the decode loop); versions that
# failed, and versions a newer one replaced before the engine took them.
ACTOR_DECODE_STALL_S = "actor/decode_stall_s"
ACTOR_DECODE_S_DURING_DELIVERY = "actor/decode_s_during_delivery"
ACTOR_DECODE_STALL_FRAC = "actor/decode_stall_frac"
ACTOR_WEIGHT_LOAD_S = "actor/weight_load_s"
ACTOR_WEIGHT_FETCH_FAILURES = "actor/weight_fetch_failures"
ACTOR_WEIGHT_SUPERSEDED = "actor/weight_superseded"
# The host cache (common/weights/host_cache.py): cached copies refused (not this user's alone, a symlink,
# or bytes that do not hash to the manifest's weights_sha256); Redis served those fetches.
ACTOR_HOST_CACHE_REFUSED = "actor/host_cache_refused"
# The node-local weight plane (common/weights/publish/node_plane.py): bytes of weight chunks this
# actor read from Redis, and versions it read from Redis chunks although it has a host cache (the
# learner's copy in that cache was absent, refused or not written: a fallback).
ACTOR_REDIS_CHUNK_BYTES = "actor/redis_chunk_bytes"
ACTOR_WEIGHT_REDIS_FALLBACKS = "actor/weight_redis_fallbacks"
# With actor.weights_group: versions received through the learner's weights group, and through
# Redis (before joining, or where the group cannot serve).
ACTOR_WEIGHT_VERSIONS_COLLECTIVE = "actor/weight_versions_collective"
ACTOR_WEIGHT_VERSIONS_REDIS = "actor/weight_versions_redis"
# Fetches from Redis by a member of the weights group whose group had not brought the version
# Redis announced within actor.weights_group_fallback_s (the sender failed to deliver it).
ACTOR_WEIGHT_GROUP_FALLBACKS = "actor/weight_group_fallbacks"
# Prompts an engine refused as too long for it (vLLM: longer than engine.vllm_max_model_len
# minus one new token), per batch: never generated; the rest of the batch was served.
ACTOR_PROMPTS_TOO_LONG = "actor/prompts_too_long"

# Speculative decoding, per batch (from the engine's counters).
SPEC_ACCEPTANCE_POS_PREFIX = "spec/acceptance_pos"
SPEC_ACCEPTANCE_RATE = "spec/acceptance_rate"
SPEC_DRAFT_LAYER_PASSES_PER_TOKEN = "spec/draft_layer_passes_per_token"
SPEC_DRAFT_TOKENS = "spec/draft_tokens"
SPEC_DRAFT_VERSION = "spec/draft_version"
"""Either engine, ``spec.method=eagle3``: the weights version of the EAGLE-3 head that drafted
last (the policy's version: the head comes with every version)."""
# Adaptive draft length (spec.adaptive): share of decoding steps that chose draft length n
# (``spec/draft_len_k{n}``; 0 = a plain step), and (hybrid) the share of steps per drafter
# (``spec/drafter_{plain,ngram,early_exit}``).
SPEC_DRAFT_LEN_PREFIX = "spec/draft_len_"
SPEC_DRAFTER_PREFIX = "spec/drafter_"
SPEC_EXIT_KL = "spec/exit_kl"
SPEC_DRAFT_ACCEPTANCE = "spec/draft_acceptance"
"""Learner: mean over completion tokens of sum_v min(p, q), p the policy, q its draft adapter
or (``spec.method=eagle3``) its EAGLE-3 head."""
SPEC_DRAFT_CHAIN_ESTIMATE = "spec/draft_chain_estimate"
"""Learner, ``eagle3``: 1 + sum_j prod_{i<=j} a_i over the trained draft steps' acceptances a_i
of the batch (``spec/draft_acceptance_step{j}``, measured before the update): the tokens per
verify a chain of that length would give at those rates."""
SPEC_EAGLE_LR = "spec/eagle_lr"
"""Learner, ``eagle3``: the head's learning rate at its last update (warm-up included)."""
SPEC_EAGLE_KL = "spec/eagle_kl"
"""Learner, ``spec.method=eagle3``: the EAGLE-3 head's loss, KL(p || q) summed over completion
positions over the batch's completion tokens (learner/eagle_loss.py)."""
SPEC_FORWARDS_PER_TOKEN = "spec/forwards_per_token"
SPEC_MEAN_ACCEPTED_LEN = "spec/mean_accepted_len"
SPEC_MEAN_DRAFT_LEN = "spec/mean_draft_len"  # adaptive: mean chosen draft length
# Tokens emitted per forward that verified drafts (all rows of the step together).
SPEC_TOKENS_PER_VERIFY_FORWARD = "spec/tokens_per_verify_forward"

# Delayed verification of rollouts in flight at a weight swap.
VERIFY_ACCEPTANCE_GAP_PREFIX = "verify/acceptance_gap"
VERIFY_ACCEPTANCE_GAP1 = "verify/acceptance_gap1"
VERIFY_FORWARD_TOKENS = "verify/forward_tokens"
VERIFY_INFLIGHT_TOKENS = "verify/inflight_tokens"
VERIFY_RECORD_BYTES_PER_TOKEN = "verify/record_bytes_per_token"
VERIFY_SALVAGED_FRAC = "verify/salvaged_frac"
VERIFY_SALVAGED_TOKENS = "verify/salvaged_tokens"
VERIFY_SWAPS = "verify/swaps"
VERIFY_WASTED_TOKENS = "verify/wasted_tokens"

# The actor's ZeroMQ sender.
SENDER_ACKED_TOTAL = "sender/acked_total"
SENDER_BAD_REPLIES = "sender/bad_replies"
SENDER_CONNECTS = "sender/connects"
SENDER_RECONNECTS = "sender/reconnects"
SENDER_REFUSED_PREFIX = "sender/refused/"
SENDER_REFUSED_TOTAL = "sender/refused_total"
SENDER_RESENT_TOTAL = "sender/resent_total"
SENDER_SUBMIT_BLOCKED_S = "sender/submit_blocked_s"
SENDER_UNACKED = "sender/unacked"
SENDER_UNSENT = "sender/unsent"

# Learner: one record per optimizer step.
LEARNER_ABS_LOG_RATIO = "learner/abs_log_ratio"
LEARNER_CLIP_FRAC = "learner/clip_frac"
LEARNER_COMPLETION_LEN_MEAN = "learner/completion_len_mean"
LEARNER_DROPPED_STALE = "learner/dropped_stale"
# The staleness bound in force for the step (learner.max_staleness, or raised to the measured
# weight-delivery lag + 1 with learner.max_staleness_from_lag).
LEARNER_MAX_STALENESS = "learner/max_staleness"
# Versions published that the slowest live actor did not hold at its last batch, the most over
# the last steps (learner/buffer.py DeliveryLag).
LEARNER_WEIGHT_DELIVERY_LAG = "learner/weight_delivery_lag"
LEARNER_FINISHED_FRAC = "learner/finished_frac"
LEARNER_GRAD_NORM = "learner/grad_norm"
LEARNER_GROUPS = "learner/groups"
# Groups skipped by learner.dynamic_sampling: all their rewards equal (no signal), never trained.
LEARNER_GROUPS_SKIPPED_NO_SIGNAL = "learner/groups_skipped_no_signal"
LEARNER_KL = "learner/kl"
LEARNER_LOSS = "learner/loss"
LEARNER_MICROBATCHES = "learner/microbatches"
LEARNER_OUTSIDE_NUCLEUS_FRAC = "learner/outside_nucleus_frac"
LEARNER_PG_LOSS = "learner/pg_loss"
LEARNER_PUBLISH_REFUSED = "learner/publish_refused"
LEARNER_PUBLISH_S = "learner/publish_s"
# Versions replaced by a newer one before their upload started (learner.publish_latest_wins).
LEARNER_PUBLISH_SKIPPED_VERSIONS = "learner/publish_skipped_versions"
LEARNER_PUBLISH_UPLOAD_S = "learner/publish_upload_s"
LEARNER_RATIO_MEAN = "learner/ratio_mean"
LEARNER_REJECTED_GROUPS = "learner/rejected_groups"
LEARNER_REPUBLISHED = "learner/republished"
LEARNER_REWARD_MAX = "learner/reward_max"
LEARNER_REWARD_MEAN = "learner/reward_mean"
LEARNER_SKIPPED = "learner/skipped"
LEARNER_SKIPPED_STEPS = "learner/skipped_steps"
LEARNER_STALENESS_HIST = "learner/staleness_hist"
LEARNER_STALENESS_MAX = "learner/staleness_max"
LEARNER_STALENESS_MEAN = "learner/staleness_mean"
LEARNER_STEP = "learner/step"
LEARNER_TOKENS = "learner/tokens"
LEARNER_TRAIN_S = "learner/train_s"
LEARNER_TRUNCATED_FRAC = "learner/truncated_frac"
LEARNER_VERSION = "learner/version"
LEARNER_WAIT_S = "learner/wait_s"
LEARNER_WALL_S = "learner/wall_s"
LEARNER_WAL_SKIPPED = "learner/wal_skipped"
# The weights group's sender (learner.weights_group, common/weights/publish/collective_sender.py): actors in the
# current epoch, the epoch, versions broadcast and the newest, versions skipped for a newer one,
# refused as non-finite, epochs lost, the last broadcast's seconds, joins refused for a missing
# or wrong proof of the run's secret, sender errors (a version it failed to send: members fetch
# it from Redis) and the version of the last error (-1: none).
LEARNER_WEIGHTS_GROUP_MEMBERS = "learner/weights_group_members"
LEARNER_WEIGHTS_GROUP_EPOCH = "learner/weights_group_epoch"
LEARNER_WEIGHTS_GROUP_VERSIONS_SENT = "learner/weights_group_versions_sent"
LEARNER_WEIGHTS_GROUP_SENT_VERSION = "learner/weights_group_sent_version"
LEARNER_WEIGHTS_GROUP_SKIPPED = "learner/weights_group_skipped"
LEARNER_WEIGHTS_GROUP_REFUSED = "learner/weights_group_refused"
LEARNER_WEIGHTS_GROUP_LOSSES = "learner/weights_group_losses"
LEARNER_WEIGHTS_GROUP_SEND_S = "learner/weights_group_send_s"
LEARNER_WEIGHTS_GROUP_JOINS_REFUSED = "learner/weights_group_joins_refused"
LEARNER_WEIGHTS_GROUP_ERRORS = "learner/weights_group_errors"
LEARNER_WEIGHTS_GROUP_ERROR_VERSION = "learner/weights_group_error_version"

# The learner's ZeroMQ receiver and intake.
RECEIVER_ACKS_SENT = "receiver/acks_sent"
RECEIVER_BAD_FRAMES = "receiver/bad_frames"
RECEIVER_BAD_FRAMES_PREFIX = "receiver/bad_frames/"
RECEIVER_DISCONNECTS = "receiver/disconnects"
RECEIVER_DUPLICATES = "receiver/duplicates"
RECEIVER_HANDOVER_DROPPED = "receiver/handover_dropped"
RECEIVER_HEARTBEATS = "receiver/heartbeats"
RECEIVER_LIVE_ACTORS = "receiver/live_actors"
RECEIVER_QUEUE_SIZE = "receiver/queue_size"
RECEIVER_RECEIVED = "receiver/received"
RECEIVER_REFUSED = "receiver/refused"
RECEIVER_REFUSED_PREFIX = "receiver/refused/"
RECEIVER_UNAUTHENTICATED = "receiver/unauthenticated"

# Multi-turn episodes (actors/episodes/runner.py): per batch,
# model turns per episode, the share of an episode's completion tokens the environment wrote,
# episodes by why they stopped (``env/stop/<reason>``) and environment failures by kind
# (``env/failures/<crashed|timeout|invalid|raised>``), malformed actions, observations cut by
# ``env.max_obs_chars``/``max_obs_tokens``, seconds in environment steps, and the share of the
# decode loop's time it had no row to decode while environments answered.
ENV_TURNS_MEAN = "env/turns_mean"
ENV_TOKEN_FRAC = "env/token_frac"
ENV_STOP_PREFIX = "env/stop/"
ENV_FAILURES_PREFIX = "env/failures/"
ENV_MALFORMED_ACTIONS = "env/malformed_actions"
ENV_OBS_TRUNCATED = "env/obs_truncated"
ENV_STEP_S = "env/step_s"
ENV_DECODE_IDLE_FRAC = "env/decode_idle_frac"
ENV_BRIDGE_MISMATCHES = "env/bridge_mismatches"
"""``env.check_bridge=always``: ended episodes whose conversation the template renders whole
differently from the bridge turn by turn."""
ENV_RESET_MISMATCH = "env/reset_mismatch"
"""Groups refused before decoding: their siblings' first observations differ."""
ENV_GROUPS_DROPPED = "env/groups_dropped"
"""Groups not sent: an environment failed (``env.on_failure=drop_group``) or one failed before
its first turn."""

ALL = frozenset(
    value
    for name, value in dict(globals()).items()
    if name.isupper() and not name.endswith(("_PREFIX", "_GROUP")) and isinstance(value, str)
)
"""Every whole key (not the prefixes)."""

PREFIXES = tuple(
    value
    for name, value in dict(globals()).items()
    if name.endswith("_PREFIX") and isinstance(value, str)
)
"""The starts of key families (``<prefix><reason or position>``)."""


def is_known(key: str) -> bool:
    """Whether ``key`` is a registered key or a member of a registered family."""
    return key in ALL or key.startswith(PREFIXES)
