#!/bin/sh
# The learner of a specrl deployment (docker/k8s): one pod, LEARNER_GPUS ranks. Above 1 it runs
# under torchrun (FSDP2, one rank per GPU of the pod), else specrl-learner as one process.
# The Redis password is in SPECRL_REDIS_PASSWORD (from the Secret), never on the command line.
# SPECRL_NODE_ARGS (the overlay's overrides) and LEARNER_ARGS come last: a later override wins.
set -eu
set -f  # the ARGS variables split into words; no file name expansion
if [ "${LEARNER_GPUS:-1}" -gt 1 ]; then
  set -- torchrun --standalone --nproc-per-node "$LEARNER_GPUS" -m learner.main
else
  set -- specrl-learner
fi
# shellcheck disable=SC2086 # SPECRL_NODE_ARGS and LEARNER_ARGS are lists of overrides
exec "$@" "run.name=${RUN_NAME}" "run.dir=/runs/${RUN_NAME}" \
  "redis.url=redis://${SPECRL_REDIS_HOST}:${SPECRL_REDIS_PORT}/0" \
  "learner.bind=tcp://0.0.0.0:${SPECRL_LEARNER_PORT}" \
  "learner.address=tcp://${SPECRL_LEARNER_HOST}:${SPECRL_LEARNER_PORT}" \
  "learner.metrics_port=${SPECRL_LEARNER_METRICS_PORT}" "security.metrics_host=0.0.0.0" \
  "security.curve_dir=${SPECRL_CURVE_DIR}" \
  ${SPECRL_NODE_ARGS:-} ${LEARNER_ARGS:-}
