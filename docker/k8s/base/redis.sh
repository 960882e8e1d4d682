#!/bin/sh
# Redis of a specrl deployment (docker/k8s): the weights versions in memory only, behind a
# password. The password comes from the Secret in REDIS_PASSWORD and reaches redis-server in a
# config file only its user can read (umask 077), never on a command line (/proc/*/cmdline).
# A password still holding the base's placeholder is refused: replace the Secret first
# (docs/clusters.md "Secrets").
set -eu
password=${REDIS_PASSWORD:?REDIS_PASSWORD is not set (the Secret key redis-password)}
case "$password" in
  CHANGE-ME*)
    echo "redis: the Secret's redis-password is the base's placeholder; replace the Secret (docs/clusters.md)" >&2
    exit 2 ;;
  *[!A-Za-z0-9_.+/=-]*)
    echo "redis: redis-password may hold letters, digits and _.+/=- only" >&2
    exit 2 ;;
esac
if [ "${#password}" -lt 16 ]; then
  echo "redis: redis-password is shorter than 16 characters" >&2
  exit 2
fi
conf="${TMPDIR:-/tmp}/specrl-redis.conf"
umask 077
printf 'requirepass %s\n' "$password" >"$conf"
# No AOF, no RDB snapshots: a restarted Redis starts empty and the learner publishes its current
# version again. noeviction: a write past maxmemory fails instead of evicting retained chunks.
exec redis-server "$conf" --port "${SPECRL_REDIS_PORT}" --bind 0.0.0.0 \
  --appendonly no --save "" \
  --maxmemory "${SPECRL_REDIS_MAXMEMORY}" --maxmemory-policy noeviction
