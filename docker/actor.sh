#!/bin/sh
# Entry point of an actor replica (docker-compose.yml): gives each container its own identity,
# then execs specrl-actor with the compose file's addresses, the node's overrides
# (SPECRL_NODE_ARGS: model.path, task.path, vLLM's GPU share, set by the GPU compose files) and
# any extra overrides ("$@", ACTOR_ARGS), in that order: a later override wins.
#
# Replicas of one compose service share their command, so `actor.index` (which seeds the actor's
# prompts and sampling by default) would be 0 in all of them and every replica would roll out the
# same completions. The container's id is unique per replica and survives a restart of the same
# container, so it names the actor (a restarted actor finds its spool under the same name), picks
# its index (0-999) and its seed (28 bits). Actors that are services of their own
# (docker-compose.gpu.yml: actor, actor-1, ...) get their index from SPECRL_ACTOR_INDEX instead.
# The Redis password is not on the command line (any user of the host can read it in
# /proc/*/cmdline): specrl-actor reads it from SPECRL_REDIS_PASSWORD, set by the compose file.
set -eu
cid=$(sed -n 's#.*/containers/\([0-9a-f]\{64\}\)/hostname .*#\1#p' /proc/self/mountinfo | head -n 1)
if [ -z "$cid" ]; then
  # Not under Docker (or an unusual runtime): the hostname, else a random id.
  cid=$(hostname | tr -cd '0-9a-f')
  [ "${#cid}" -ge 12 ] || cid=$(tr -cd '0-9a-f' </proc/sys/kernel/random/uuid)
fi
short=$(printf '%.12s' "$cid")
index=${SPECRL_ACTOR_INDEX:-$((0x$(printf '%.4s' "$cid") % 1000))}
# The seed of its prompts and sampling: 28 bits of the id (index alone would collide 1 in 1,000).
seed=$((0x$(printf '%.7s' "$cid")))
# Metrics: actor i serves on actor.metrics_port + i; keep every replica on SPECRL_ACTOR_METRICS_PORT
# (its own network namespace). 0 (host networking) means any free port.
metrics_port=${SPECRL_ACTOR_METRICS_PORT:-9401}
[ "$metrics_port" = 0 ] || metrics_port=$((metrics_port - index))
echo "actor.sh: container ${short}: actor.actor_id=actor-${short} actor.index=${index} actor.seed=${seed}"
set -f  # SPECRL_NODE_ARGS splits into words; no file name expansion
exec specrl-actor \
  "run.name=${RUN_NAME}" "run.dir=/runs/${RUN_NAME}" \
  "redis.url=redis://${SPECRL_REDIS_HOST}:${SPECRL_REDIS_PORT}/0" \
  "learner.address=tcp://${SPECRL_LEARNER_HOST}:${SPECRL_LEARNER_PORT}" \
  "actor.device=${SPECRL_ACTOR_DEVICE:-cpu}" \
  "actor.actor_id=actor-${short}" "actor.index=${index}" "actor.seed=${seed}" \
  "actor.metrics_port=${metrics_port}" "security.metrics_host=${SPECRL_METRICS_HOST}" \
  "redis.host_cache_dir=${SPECRL_HOST_CACHE_DIR:-/dev/shm}" \
  ${SPECRL_NODE_ARGS:-} "$@"
