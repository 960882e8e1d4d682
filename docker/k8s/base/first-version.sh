#!/bin/sh
# Exit 0 once the run's first weights version is in Redis: the learner's readiness probe, and
# (with --wait) the actors' init container, so actors start after the learner has published, as
# in docker-compose.yml. redis-cli reads the password from REDISCLI_AUTH (from the Secret).
set -eu
check() {
  redis-cli -h "${SPECRL_REDIS_HOST}" -p "${SPECRL_REDIS_PORT}" get "weights:${RUN_NAME}:latest" 2>/dev/null |
    grep -q '[0-9]'
}
if [ "${1:-}" = --wait ]; then
  until check; do
    echo "first-version.sh: waiting for weights:${RUN_NAME}:latest in Redis"
    sleep 5
  done
  exit 0
fi
check
