#!/usr/bin/env bash
# The docker compose stack, started for real on CPU (docker-compose.yml + docker-compose.cpu.yml):
#   1. a Docker engine: dockerd if it runs, else started here as root (Debian's docker.io is
#      installed first if missing); without one the test is skipped: exit status 0, with a banner
#      on stdout and stderr and the marker line `SPECRL-COMPOSE-SMOKE: SKIPPED: <reason>` (grep
#      CI logs for it), so a skip is never mistaken for a pass; SPECRL_SMOKE_REQUIRE=1 makes a
#      skip a failure;
#   2. the image: scripts/build-cpu-image.sh (Debian base by debootstrap, host wheelhouse; reused
#      when present);
#   3. `compose up`: Redis with a password, the learner and 2 actors, host networking, every
#      service on 127.0.0.1 on free ports, the run directory in a temporary folder;
#   4. the learner's /metrics: versions advance and groups are trained; each actor has its own
#      seed, and the actors mount one weights-cache volume that holds versions;
#   5. one actor container's process is killed (SIGKILL, as the OOM killer would): training goes
#      on, the `restart: on-failure` policy brings the container back, and the new incarnation
#      gets groups acked (its own /metrics);
#   6. `compose stop`; the learner's last checkpoint opens with learner.checkpoint.load_checkpoint.
# The exit status says whether all of that held. The stack is taken down (containers, volumes) and
# the temporary folder removed on every exit. Takes about 3 minutes with the image built.
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
log() { printf '[compose-smoke %4ss] %s\n' "$(($(date +%s) - T0))" "$*"; }
skip() {
  if [ "${SPECRL_SMOKE_REQUIRE:-0}" = 1 ]; then
    echo "compose-smoke: FAILED (SPECRL_SMOKE_REQUIRE=1): $*" >&2
    exit 1
  fi
  local rule="################################################################################"
  local banner
  banner=$(printf '%s\n' "$rule" \
    "SPECRL-COMPOSE-SMOKE: SKIPPED: $*" \
    "  The docker compose stack was NOT built, started or checked on this machine: this is" \
    "  not a pass. SPECRL_SMOKE_REQUIRE=1 makes a skip fail." \
    "$rule")
  echo "$banner"
  echo "$banner" >&2
  exit 0
}
fail() {
  echo "compose-smoke: FAILED: $*" >&2
  exit 1
}
am_root() { [ "$(id -u)" = 0 ]; }

DOCKERD_PID=""
PROJECT=""
RUNS_DIR=""
COMPOSE=()
COMPOSE_BIN=()
cleanup() {
  local rc=$?
  set +e
  if [ -n "$PROJECT" ]; then
    if [ "$rc" != 0 ]; then
      echo "---- last log lines of the stack ($PROJECT) ----"
      "${COMPOSE[@]}" logs --no-color --tail 40 2>&1 | tail -n 150
    fi
    "${COMPOSE[@]}" down -v --remove-orphans -t 20 >/dev/null 2>&1
    # Anything compose did not know about (a failed `up`), by the project label.
    docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" | xargs -r docker rm -f >/dev/null 2>&1
  fi
  [ -z "$RUNS_DIR" ] || rm -rf "$RUNS_DIR"
  if [ -n "$DOCKERD_PID" ]; then
    kill "$DOCKERD_PID" 2>/dev/null
    wait "$DOCKERD_PID" 2>/dev/null
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- 1. Docker engine and compose
apt_install() {
  am_root && command -v apt-get >/dev/null || return 1
  log "installing $* (apt-get)"
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"; } >/tmp/specrl-smoke-apt.log 2>&1 \
    || { tail -n 5 /tmp/specrl-smoke-apt.log; return 1; }
}
if ! command -v dockerd >/dev/null && ! docker info >/dev/null 2>&1; then
  apt_install docker.io || skip "no Docker engine, and docker.io could not be installed (needs root and apt)"
fi
if ! docker info >/dev/null 2>&1; then
  am_root || skip "dockerd is not running and this is not root, so it cannot be started"
  command -v dockerd >/dev/null || skip "no dockerd binary"
  log "starting dockerd (log: /tmp/specrl-smoke-dockerd.log)"
  setsid dockerd >/tmp/specrl-smoke-dockerd.log 2>&1 </dev/null &
  DOCKERD_PID=$!
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && break
    kill -0 "$DOCKERD_PID" 2>/dev/null || break
    sleep 1
  done
  docker info >/dev/null 2>&1 || {
    tail -n 5 /tmp/specrl-smoke-dockerd.log
    DOCKERD_PID=""
    skip "dockerd did not start (last lines of its log above)"
  }
fi
log "Docker engine $(docker version -f '{{.Server.Version}}' 2>/dev/null), storage $(docker info -f '{{.Driver}}' 2>/dev/null)"
if docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null || apt_install docker-compose; then
  COMPOSE=(docker-compose)
else
  skip "neither \`docker compose\` nor \`docker-compose\` is available"
fi
command -v debootstrap >/dev/null || docker image inspect specrl-base:bookworm >/dev/null 2>&1 \
  || apt_install debootstrap || skip "debootstrap is missing and could not be installed"
log "compose: $("${COMPOSE[@]}" version 2>/dev/null | head -n 1)"

# ---- 2. The image
log "building specrl-cpu:latest (scripts/build-cpu-image.sh)"
tb=$(date +%s)
bash scripts/build-cpu-image.sh 2>&1 | grep --line-buffered -v -e 'legacy builder is deprecated' -e 'buildx' -e '^ *$' -e '^DEPRECATED'
log "image ready ($(($(date +%s) - tb)) s)"

# ---- 3. compose up, on loopback ports nobody uses
free_ports() {
  python3 - <<'PY'
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}
read -r REDIS_PORT LEARNER_PORT METRICS_PORT < <(free_ports)
REDIS_PASSWORD=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
RUNS_DIR=$(mktemp -d /tmp/specrl-compose-smoke.XXXXXX)
RUN_NAME=smoke
ACTORS=2
# Long enough never to end by itself; checkpoints often enough to see some.
LEARNER_ARGS="run.steps=100000 learner.checkpoint_every=25"
export REDIS_PORT LEARNER_PORT METRICS_PORT REDIS_PASSWORD RUNS_DIR RUN_NAME ACTORS LEARNER_ARGS
PROJECT="specrl-smoke-$$-$(date +%s)"
COMPOSE_BIN=("${COMPOSE[@]}")
COMPOSE+=(-p "$PROJECT" -f docker-compose.yml -f docker-compose.cpu.yml)
# The GPU variant at least parses (it cannot start without a GPU).
"${COMPOSE_BIN[@]}" -f docker-compose.yml -f docker-compose.override.yml config -q \
  || fail "docker-compose.yml + docker-compose.override.yml (GPU) does not validate"
"${COMPOSE[@]}" config -q || fail "docker-compose.yml + docker-compose.cpu.yml does not validate"
log "up: project $PROJECT, redis 127.0.0.1:$REDIS_PORT, learner 127.0.0.1:$LEARNER_PORT, metrics 127.0.0.1:$METRICS_PORT, run dir $RUNS_DIR"
tu=$(date +%s)
"${COMPOSE[@]}" up -d --no-build 2>&1 | { grep -v "Published ports are discarded" || true; } || fail "compose up"
log "stack up, learner healthy ($(($(date +%s) - tu)) s)"

# ---- helpers on /metrics and containers
metric() { # NAME [PORT]: value of an unlabelled sample, empty if absent
  curl -sf --max-time 5 "http://127.0.0.1:${2:-$METRICS_PORT}/metrics" \
    | awk -v n="$1" '$1 == n { print $2; exit }' || true
}
gt() { awk -v a="${1:-}" -v b="${2:-}" 'BEGIN { exit !(a != "" && a + 0 > b + 0) }'; }
wait_for() { # SECONDS DESCRIPTION COMMAND...: poll every 2 s
  local limit=$1 what=$2
  shift 2
  local end=$(($(date +%s) + limit))
  until "$@"; do
    [ "$(date +%s)" -lt "$end" ] || fail "not within ${limit}s: $what"
    sleep 2
  done
}
containers() { docker ps -q --filter "label=com.docker.compose.project=$PROJECT" --filter "label=com.docker.compose.service=$1"; }
learner_at_least() { # VERSION GROUPS
  local v g
  v=$(metric specrl_learner_version)
  g=$(metric specrl_learner_groups_trained_total)
  gt "$v" "$1" && gt "$g" "$2"
}

# ---- 4. Training: versions advance, groups are trained
[ "$(containers actor | wc -l)" = "$ACTORS" ] || fail "expected $ACTORS actor containers, found $(containers actor | wc -l)"
# Each replica its own seed of prompts and sampling (actor.seed): docker/actor.sh.
seeds=$(for c in $(containers actor); do docker logs "$c" 2>&1 | sed -n 's/.*actor\.seed=\([0-9]*\).*/\1/p' | head -n 1; done | sort -u | wc -l)
[ "$seeds" = "$ACTORS" ] || fail "the $ACTORS actors do not have distinct actor.seed values"
# Redis refuses a client without the password.
redis=$(containers redis)
docker exec "$redis" redis-cli -p "$REDIS_PORT" get "weights:$RUN_NAME:latest" 2>&1 | grep -q NOAUTH \
  || fail "Redis answered without a password"
metrics_up() { [ -n "$(metric specrl_learner_version)" ]; }
wait_for 60 "learner /metrics on 127.0.0.1:$METRICS_PORT" metrics_up
v1=$(metric specrl_learner_version)
wait_for 240 "version past $v1 and groups trained" learner_at_least "$((${v1%.*} + 2))" 0
v1=$(metric specrl_learner_version)
g1=$(metric specrl_learner_groups_trained_total)
log "training: version $v1, groups trained $g1, live actors $(metric specrl_learner_live_actors)"
# One fetch per host: every replica mounts the same in-memory weights cache, and it holds versions.
cache_volumes=$(for c in $(containers actor); do
  docker inspect -f '{{range .Mounts}}{{if eq .Destination "/weights-cache"}}{{.Name}}{{end}}{{end}}' "$c"
done | sort -u)
[ "$(echo "$cache_volumes" | grep -c .)" = 1 ] || fail "the actors do not share one /weights-cache volume: ${cache_volumes:-none}"
cached_versions() {
  docker exec "$(containers actor | head -n 1)" sh -c 'ls /weights-cache/specrl-weights-*/*/ 2>/dev/null' | grep -c '^v.*\.safetensors$'
}
has_cached() { gt "$(cached_versions)" 0; }
wait_for 60 "a weights version in the actors' shared cache" has_cached
log "actors share the weights cache (volume $cache_volumes, $(cached_versions) versions held)"
# Every listening socket of the stack is on the loopback (host networking shares the host's).
if command -v ss >/dev/null; then
  for port in "$REDIS_PORT" "$LEARNER_PORT" "$METRICS_PORT"; do
    listeners=$(ss -Hltn "sport = :$port" | awk '{ print $4 }')
    [ -n "$listeners" ] || fail "nothing listens on port $port"
    if echo "$listeners" | grep -qv '^127\.0\.0\.1:'; then fail "port $port listens beyond the loopback: $listeners"; fi
  done
  log "redis, learner and /metrics listen on 127.0.0.1 only; redis refuses clients without the password"
fi

# ---- 5. Kill one actor; training goes on; the actor comes back
victim=$(containers actor | head -n 1)
name=$(docker inspect -f '{{.Name}}' "$victim")
restarts=$(docker inspect -f '{{.RestartCount}}' "$victim")
killed_at=$(date +%s)
kill -9 "$(docker inspect -f '{{.State.Pid}}' "$victim")"
log "killed the main process of actor container ${name#/} (SIGKILL)"
restarted() {
  [ "$(docker inspect -f '{{.RestartCount}} {{.State.Running}}' "$victim")" = "$((restarts + 1)) true" ]
}
wait_for 60 "the killed actor container restarted (restart: on-failure)" restarted
log "actor container ${name#/} restarted by Docker ($(docker inspect -f '{{.RestartCount}}' "$victim") restart)"
wait_for 180 "training past version $v1 / $g1 groups after the kill" learner_at_least "${v1%.*}" "${g1%.*}"
# The new incarnation's own /metrics: its port file (actor-<index>.port) is rewritten at start.
index=$(docker logs "$victim" 2>&1 | sed -n 's/.*actor\.index=\([0-9]*\).*/\1/p' | tail -n 1)
[ -n "$index" ] || fail "no actor.index in the restarted actor's log"
port_file="$RUNS_DIR/$RUN_NAME/prometheus/actor-$index.port"
acked_again() {
  local port
  # Written by the new incarnation, not left over from the killed one.
  [ -f "$port_file" ] && [ "$(stat -c %Y "$port_file")" -ge "$killed_at" ] || return 1
  port=$(cat "$port_file" 2>/dev/null) || return 1
  [ -n "$port" ] && curl -sf --max-time 5 "http://127.0.0.1:$port/metrics" \
    | awk '$1 ~ /^specrl_actor_groups_acked_total/ && $2 + 0 > 0 { ok = 1 } END { exit !ok }'
}
wait_for 180 "groups acked to the restarted actor (its /metrics, $port_file)" acked_again
v2=$(metric specrl_learner_version)
g2=$(metric specrl_learner_groups_trained_total)
log "after the kill: version $v1 -> $v2, groups trained $g1 -> $g2; restarted actor has groups acked"
[ "$(containers actor | wc -l)" = "$ACTORS" ] || fail "expected $ACTORS running actor containers after the restart"

# ---- 6. Stop; the checkpoint opens
log "stopping the stack (SIGTERM: the learner checkpoints on the way out)"
"${COMPOSE[@]}" stop -t 60 >/dev/null 2>&1 || fail "compose stop"
learner=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" --filter "label=com.docker.compose.service=learner")
code=$(docker inspect -f '{{.State.ExitCode}}' "$learner")
[ "$code" = 0 ] || fail "learner exited with status $code"
docker run --rm --network none -v "$RUNS_DIR:/runs" specrl-cpu:latest python -c '
import sys
from pathlib import Path

import torch

from learner.checkpoint import latest_checkpoint, load_checkpoint

path = latest_checkpoint(Path(sys.argv[1]) / "checkpoints")
assert path is not None, "no checkpoint"
model, optimizer, state, _ = load_checkpoint(path, torch.device("cpu"))
params = sum(p.numel() for p in model.parameters())
assert state.step > 0 and optimizer, state.step
assert state.version >= float(sys.argv[2]), (state.version, sys.argv[2])
print(f"{path.name}: step {state.step}, version {state.version}, {params} parameters, {len(optimizer)} optimizer tensors")
' "/runs/$RUN_NAME" "$v2" | sed 's/^/[checkpoint] /' || fail "the run directory's checkpoint does not open"
log "PASSED (total $(($(date +%s) - T0)) s)"
