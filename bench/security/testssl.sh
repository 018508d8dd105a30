#!/usr/bin/env bash
# Scan a locally started switch's WAN port with testssl.sh and keep the report.
#
#   bench/security/testssl.sh [OUT_DIR]     (default: bench-results/security/testssl-<UTC time>)
#
# Installs Debian's testssl.sh with apt if it is missing (needs root), starts cluster b's switch and
# auth service via bench/security/serve_switch.py on a scratch PKI, runs testssl.sh against the WAN
# port (protocols, cipher categories, server preferences, per-protocol cipher list, vulnerabilities),
# and writes OUT_DIR/testssl.log (plain text) and OUT_DIR/testssl.json. Not part of `make test`.
#
# testssl.sh 3.0 (Debian 12) cannot present a client certificate; the switch asks for one only
# after ServerHello, so protocol and cipher negotiation (what this scan is about) is still visible,
# while checks that need application data over a finished handshake report errors.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
out="${1:-$repo/bench-results/security/testssl-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$out"

if ! command -v testssl >/dev/null 2>&1 && ! command -v testssl.sh >/dev/null 2>&1; then
    echo "testssl.sh not found; installing Debian's package" >&2
    apt-get install -y -q testssl.sh >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q testssl.sh >/dev/null; }
fi
scanner="$(command -v testssl || command -v testssl.sh)"

scratch="$(mktemp -d)"
info="$scratch/ready.json"
(cd "$repo" && exec "$python" -m bench.security.serve_switch --dir "$scratch/run") >"$info" 2>"$out/switch.log" &
server=$!
cleanup() {
    kill -TERM "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
    rm -rf "$scratch"
}
trap cleanup EXIT

for _ in $(seq 1 300); do
    [[ -s "$info" ]] && break
    kill -0 "$server" 2>/dev/null || { echo "switch failed to start, see $out/switch.log" >&2; exit 1; }
    sleep 0.1
done
[[ -s "$info" ]] || { echo "switch did not report its port within 30 s" >&2; exit 1; }
port="$("$python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["wan_port"])' "$info")"
echo "scanning switch WAN port 127.0.0.1:$port with $("$scanner" --version 2>/dev/null | grep -m1 -o 'testssl.sh *[0-9.a-z+-]*' || echo "$scanner")" >&2

# Exit status of testssl.sh counts findings, so it is recorded, not treated as a script failure.
set +e
"$scanner" --quiet --color 0 --warnings off --openssl-timeout 10 \
    --protocols --std --server-preference --each-cipher --vulnerable \
    --logfile "$out/testssl.log" --jsonfile "$out/testssl.json" \
    "127.0.0.1:$port"
status=$?
set -e
echo "testssl.sh exit status $status; report: $out/testssl.log" >&2
