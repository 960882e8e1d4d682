#!/bin/sh
# An actor of a specrl deployment (docker/k8s): its identity is the StatefulSet pod's ordinal.
# POD_NAME (the downward API's metadata.name) is <statefulset>-<ordinal>: the ordinal is the
# actor's index (which seeds its prompts and sampling), the pod name its actor_id. Both survive
# a restart or a rescheduling of the pod, so a restarted actor finds its spool on its volume and
# resends what the learner had not acked.
# Metrics: actor i serves on actor.metrics_port + i; each pod has its own network namespace, so
# every actor serves on SPECRL_ACTOR_METRICS_PORT (what the probes and the Service name).
# The Redis password is in SPECRL_REDIS_PASSWORD (from the Secret), never on the command line.
set -eu
pod=${POD_NAME:?POD_NAME is not set (env from the downward API, fieldPath metadata.name)}
index=${pod##*-}
case "$index" in
  '' | *[!0-9]*)
    echo "actor.sh: pod name $pod does not end in a StatefulSet ordinal" >&2
    exit 2 ;;
esac
port=${SPECRL_ACTOR_METRICS_PORT:-9401}
if [ "$index" -ge "$port" ]; then
  echo "actor.sh: ordinal $index is not below the metrics port $port" >&2
  exit 2
fi
echo "actor.sh: pod ${pod}: actor.actor_id=${pod} actor.index=${index}"
set -f  # the ARGS variables split into words; no file name expansion
# shellcheck disable=SC2086 # SPECRL_NODE_ARGS and ACTOR_ARGS are lists of overrides
exec specrl-actor "run.name=${RUN_NAME}" "run.dir=/runs/${RUN_NAME}" \
  "redis.url=redis://${SPECRL_REDIS_HOST}:${SPECRL_REDIS_PORT}/0" \
  "learner.address=tcp://${SPECRL_LEARNER_HOST}:${SPECRL_LEARNER_PORT}" \
  "actor.device=${SPECRL_ACTOR_DEVICE:-cpu}" \
  "actor.actor_id=${pod}" "actor.index=${index}" \
  "actor.metrics_port=$((port - index))" "security.metrics_host=0.0.0.0" \
  "redis.host_cache_dir=${SPECRL_HOST_CACHE_DIR}" "security.curve_dir=${SPECRL_CURVE_DIR}" \
  ${SPECRL_NODE_ARGS:-} ${ACTOR_ARGS:-}
