#!/usr/bin/env bash
# Two organisations in containers: each its own PKI (`nebula pki init --cluster`), CA certificates
# exchanged with fingerprints, each its own compose project from docker/compose-organisation.yml,
# the switches on one shared WAN network, a's switch dialing b's; then docker/smoke.py trains the
# numbers job between them and both projects go down -v. Prints each phase's time.
#
#   bash docker/run-smoke-organisations.sh [--steps 20]
#
# Needs podman + podman-compose (see docker/run-smoke.sh) and the host venv for the CLI and the SDK.
# The image is docker-compose.yml's localhost/nebula:dev, built the way `podman-compose build` builds
# it (torch from the local CPU wheels where /opt/wheels exists: the podman-compose wrapper mounts them)
# and refreshed through its layer cache, so a second image is never made; NEBULA_BUILD=0 uses :dev as
# it is, and another NEBULA_IMAGE is used as it is. Host ports: a 37400/37500/37600/39100,
# b 47400/47500/47600/49100, b's WAN port 47443.
set -euo pipefail
cd "$(dirname "$0")/.."

COMPOSE=${COMPOSE:-podman-compose}
PYTHON=${PYTHON:-.venv/bin/python}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-240}
DEV_IMAGE=localhost/nebula:dev
export NEBULA_IMAGE=${NEBULA_IMAGE:-$DEV_IMAGE}
# One host plays both organisations: their switches share one WAN network (on two hosts, a dials
# b's published WAN port instead; container-to-host-port traffic is blocked on these machines).
export NEBULA_WAN_NETWORK=${NEBULA_WAN_NETWORK:-nebula-orgs-smoke-wan}
[ "$#" -gt 0 ] || set -- --steps 20
work=$(mktemp -d /tmp/nebula-orgs-smoke.XXXXXX)
start=$SECONDS
phase=$SECONDS
lap() { echo "run-smoke-organisations: $1 $((SECONDS - phase)) s (total $((SECONDS - start)) s)" >&2; phase=$SECONDS; }
nebula() { PYTHONPATH=$PWD "$PYTHON" -m nebula_common.cli.app "$@"; }
org() {  # org CLUSTER PEER PORT_BASE [PEER_ADDRESS] -- compose args...
  local cluster=$1 peer=$2 base=$3 address=$4; shift 4
  NEBULA_CLUSTER=$cluster NEBULA_PEER=$peer NEBULA_PEER_ADDRESS=$address NEBULA_PORT_BASE=$base \
    NEBULA_PKI_DIR=$work/pki-$cluster NEBULA_WAN_PUBLISH=0.0.0.0:${base}7443 \
    $COMPOSE -p "nebula-org-$cluster" -f docker/compose-organisation.yml "$@"
}

cleanup() {
  status=$?
  if [ "$status" -ne 0 ]; then
    echo "run-smoke-organisations: FAILED (exit $status); container states and log tails follow" >&2
    for c in $(podman ps -a --format '{{.Names}}' | grep '^nebula-org-'); do
      echo "--- $c: $(podman inspect -f '{{.State.Status}}' "$c")" >&2
      podman logs --tail 5 "$c" >&2 || true
    done
  fi
  if [ "${KEEP:-0}" != 1 ]; then
    org a b 3 "" down -v >/dev/null 2>&1 || true
    org b a 4 "" down -v >/dev/null 2>&1 || true
    rm -rf "$work"
  fi
  exit "$status"
}
trap cleanup EXIT

if [ "$NEBULA_IMAGE" = "$DEV_IMAGE" ] && [ "${NEBULA_BUILD:-1}" = 1 ]; then
  $COMPOSE -f docker-compose.yml build >/dev/null  # docker-compose.yml's one build: the :dev image
elif ! podman image exists "$NEBULA_IMAGE"; then
  echo "run-smoke-organisations: image $NEBULA_IMAGE not found (build it, or unset NEBULA_IMAGE)" >&2
  exit 1
fi
lap "build"

for c in a b; do
  nebula pki init --dir "$work/pki-$c" --cluster "$c" >/dev/null
  nebula pki export-ca --dir "$work/pki-$c" --cluster "$c" --out "$work/$c-ca.crt" >"$work/$c.fingerprint"
done
nebula pki trust add --dir "$work/pki-a" --cluster a --peer b --ca "$work/b-ca.crt" --fingerprint "$(cat "$work/b.fingerprint")"
nebula pki trust add --dir "$work/pki-b" --cluster b --peer a --ca "$work/a-ca.crt" --fingerprint "$(cat "$work/a.fingerprint")"
lap "PKIs and CA exchange"

org b a 4 "" up -d
org a b 3 "nebula-org-b_switch_1:7443" up -d
lap "up -d (both organisations)"

deadline=$((SECONDS + HEALTH_TIMEOUT))
while :; do
  unhealthy=()
  for c in $(podman ps -a --format '{{.Names}}' | grep '^nebula-org-' | grep -v -e pki-export -e signer-init); do
    podman healthcheck run "$c" >/dev/null 2>&1 || unhealthy+=("$c")
  done
  [ "${#unhealthy[@]}" -eq 0 ] && break
  if [ "$SECONDS" -gt "$deadline" ]; then
    echo "run-smoke-organisations: not healthy after ${HEALTH_TIMEOUT} s: ${unhealthy[*]}" >&2
    exit 1
  fi
  sleep 2
done
lap "healthy"

NEBULA_ADMIN_PASSWORD_A=$(podman exec nebula-org-a_auth_1 cat /etc/nebula/admin/admin-password) \
NEBULA_ADMIN_PASSWORD_B=$(podman exec nebula-org-b_auth_1 cat /etc/nebula/admin/admin-password) \
  PYTHONPATH=$PWD "$PYTHON" docker/smoke.py --host-ports-a 37400,37500,37600,39100 \
  --host-ports-b 47400,47500,47600,49100 \
  --ca-a "$work/pki-a/a/ca.crt" --ca-b "$work/pki-b/b/ca.crt" \
  --audit-exec "podman exec" --edge-transports nebula-org-a_switch_1=records,nebula-org-b_switch_1=records \
  "$@"  # internal TLS: each org's own CA; each org's stages' edges as records on its switch's edge socket
lap "smoke job"
