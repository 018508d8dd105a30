#!/usr/bin/env bash
# Container smoke test, start to finish: build the image, start both simulated clusters with
# docker-compose.yml, wait until every service is healthy, run docker/smoke.py (the built-in numbers
# job, encoder in a, decoder in b), then `down -v`. Prints each phase's time; exits non-zero on failure.
#
#   make smoke-containers                     # = bash docker/run-smoke.sh --steps 60
#   bash docker/run-smoke.sh --steps 30 --codec-forward int8 --codec-backward fp16
#
# Needs podman + podman-compose (bash /work/shared/containers/setup-podman.sh on these machines) and
# the host venv (`make install`) for the SDK. Not part of `make test` or .ci/run.
# PROJECT (compose project name, default nebula), COMPOSE (default podman-compose -p $PROJECT),
# PYTHON (default .venv/bin/python), HEALTH_TIMEOUT (default 180 s) and KEEP=1 (leave the deployment up) can be set in the environment. Arguments go to smoke.py.
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT=${PROJECT:-nebula}
COMPOSE=${COMPOSE:-podman-compose -p $PROJECT}
PYTHON=${PYTHON:-.venv/bin/python}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-180}
[ "$#" -gt 0 ] || set -- --steps 60

start=$SECONDS
phase=$SECONDS
lap() { echo "run-smoke: $1 $((SECONDS - phase)) s (total $((SECONDS - start)) s)" >&2; phase=$SECONDS; }

cleanup() {
  status=$?
  if [ "$status" -ne 0 ]; then
    echo "run-smoke: FAILED (exit $status); container states and log tails follow" >&2
    podman ps -a --format '{{.Names}} {{.Status}}' >&2 || true
    for c in $(podman ps -a --filter label=io.podman.compose.project="$PROJECT" --format '{{.Names}}'); do
      echo "--- $c" >&2
      podman logs --tail 5 "$c" >&2 || true
    done
  fi
  if [ "${KEEP:-0}" != 1 ]; then
    phase=$SECONDS
    $COMPOSE --profile monitoring down -v >/dev/null 2>&1 || true
    lap "down -v"
  fi
  exit "$status"
}

$COMPOSE build
$COMPOSE --profile monitoring build prometheus-a
lap "build"

trap cleanup EXIT
$COMPOSE up -d
lap "up -d"

# podman 4.3 runs healthchecks only when asked (no systemd timers), so ask until all pass.
deadline=$((SECONDS + HEALTH_TIMEOUT))
while :; do
  unhealthy=()
  for c in $(podman ps -a --filter label=io.podman.compose.project="$PROJECT" --format '{{.Names}}'); do
    case "$c" in *pki-init* | *signer-init*) continue ;; esac
    podman healthcheck run "$c" >/dev/null 2>&1 || unhealthy+=("$c")
  done
  [ "${#unhealthy[@]}" -eq 0 ] && break
  if [ "$SECONDS" -gt "$deadline" ]; then
    echo "run-smoke: not healthy after ${HEALTH_TIMEOUT} s: ${unhealthy[*]}" >&2
    exit 1
  fi
  sleep 1
done
lap "every service healthy"

# The `monitoring` profile's Prometheus of each cluster (Grafana is an upstream image: not pulled here),
# scraping from before the job on, so the checks after it see the job's series.
$COMPOSE --profile monitoring up -d --no-deps prometheus-a prometheus-b
monitoring_since=$(date +%s)
"$PYTHON" docker/smoke_monitoring.py --compose "$COMPOSE" --since "$monitoring_since" --targets-only >/dev/null
lap "monitoring profile up, every service scraped over mutual TLS"

NEBULA_ADMIN_PASSWORD_A="$($COMPOSE exec -T auth-a cat /etc/nebula/admin/admin-password)"
NEBULA_ADMIN_PASSWORD_B="$($COMPOSE exec -T auth-b cat /etc/nebula/admin/admin-password)"
export NEBULA_ADMIN_PASSWORD_A NEBULA_ADMIN_PASSWORD_B
# Every published port is internal TLS: the host's SDK verifies each cluster against its own CA.
ca_dir=$(mktemp -d)
$COMPOSE exec -T auth-a cat /etc/nebula/internal-tls/ca.crt > "$ca_dir/a-ca.crt"
$COMPOSE exec -T auth-b cat /etc/nebula/internal-tls/ca.crt > "$ca_dir/b-ca.crt"
export NEBULA_CA_CERT_A="$ca_dir/a-ca.crt" NEBULA_CA_CERT_B="$ca_dir/b-ca.crt"
# /metrics answer only each cluster's scraper identity, which only the PKI volume holds (pki-init).
for c in a b; do
  PYTHONPATH=$PWD "$PYTHON" -c 'import shlex, sys; from pathlib import Path
from nebula_common.cli.compose import fetch_monitoring_identity
fetch_monitoring_identity(shlex.split(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))' "$COMPOSE" "$c" "$ca_dir/$c-monitoring"
done
export NEBULA_MONITORING_TLS_A="$ca_dir/a-monitoring" NEBULA_MONITORING_TLS_B="$ca_dir/b-monitoring"
lap "CA certificates and scraper identities copied out"
# smoke.py also reads both switches' audit logs: every edge of its job opened as records on the edge socket.
COMPOSE="$COMPOSE" PYTHONPATH="$PWD" "$PYTHON" docker/smoke.py "$@"
lap "smoke.py $*"
# Internal TLS on this deployment: plaintext and certificate-less calls to internal ports fail, a wrong
# role is PERMISSION_DENIED and audited (probes run inside each cluster's network: docker/smoke_tls.py).
"$PYTHON" docker/smoke_tls.py --compose "$COMPOSE"
lap "smoke_tls.py (internal TLS)"
# Every key has one owner: what each service container's user can read, listed and checked.
"$PYTHON" docker/smoke_secrets.py --compose "$COMPOSE"
lap "smoke_secrets.py (one owner per key)"
# A stage written to break out: under Landlock in trainer-a's container it reaches no key,
# record, other account's files, port or process, and its refusals are audited.
COMPOSE="$COMPOSE" PYTHONPATH="$PWD" "$PYTHON" docker/smoke_hostile.py
lap "smoke_hostile.py (a hostile stage)"
# Operating it: the endpoints file, watch/status/report/logs/cancel through the CLI, and
# trainer-a killed mid-job (named volume: checkpoints and a verifying audit log survive). SMOKE_OPS=0 skips.
if [ "${SMOKE_OPS:-1}" != 0 ]; then
  COMPOSE="$COMPOSE" "$PYTHON" docker/smoke_ops.py
  lap "smoke_ops.py"
  # Every alert rule evaluated; every dashboard panel has data over the jobs above (the data-service
  # panel counts smoke_ops' `account grants`). Exactly one alert fires, in both clusters: stages failed
  # (smoke_hostile's probe stage in a, the decoder of the job smoke_ops cancels in b).
  "$PYTHON" docker/smoke_monitoring.py --compose "$COMPOSE" --since "$monitoring_since" \
    --expect-firing NebulaJobsFailing:a --expect-firing NebulaJobsFailing:b
  lap "smoke_monitoring.py (Prometheus: targets, rules, panels)"
fi
