#!/usr/bin/env bash
# signerd quick start, end to end on SoftHSM:
#
#   scripts/quickstart.sh [--keep-running] [FILE.p8]
#
# installs what is missing (Debian packages), builds signerd and signctl,
# makes a SoftHSM token with scripts/softhsm-setup.sh, generates a DEMO key
# with openssl (or imports your own App Store .p8 if you pass one), starts
# signerd, asks it over the Unix socket (curl) for a promotional offer
# signature, and verifies that signature with `openssl dgst -verify` against
# the public key exported from the token. Everything lives in
# ${SIGNERD_DEMO_DIR:-.demo} in this checkout; signerd is stopped at the end
# unless --keep-running.
#
# Environment:
#   BUNDLE_ID         the bundle ID the key may sign for (default com.example.app)
#   KEY_ID            the key ID of FILE.p8 when its name is not
#                     AuthKey_<ID>.p8 or SubscriptionKey_<ID>.p8 (signctl
#                     keys import decides, and also takes a browser's
#                     SubscriptionKey_<ID> (1).p8 and .P8)
#   ISSUER_ID         the issuer ID from App Store Connect, for the JWS kinds
#                     (with the demo key, default a placeholder; with your
#                     own key, none: the JWS kinds then answer 400 until
#                     issuer_id is set, rather than sign an iss Apple refuses)
#   SIGNERD_DEMO_DIR  where the token, configuration, socket and logs go
#                     (default .demo in this checkout)
#
# Each run writes signerd.json in that directory anew; an earlier one that
# differs (your edits, or other variables) is kept as signerd.json.previous.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
keep_running=0
p8=""
for arg in "$@"; do
  case $arg in
    --keep-running) keep_running=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    -*) printf 'error: unknown option %s\nhint: scripts/quickstart.sh [--keep-running] [FILE.p8]; --help for more\n' "$arg" >&2; exit 64 ;;
    *) p8=$arg ;;
  esac
done
if [ -n "$p8" ]; then p8=$(cd "$(dirname "$p8")" && pwd)/$(basename "$p8"); fi

# Bold only on a terminal: a log file or CI output gets the plain text.
if [ -t 1 ]; then step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }; else step() { printf '\n==> %s\n' "$*"; }; fi

step "1/8 Installing missing Debian packages (libp11-kit-dev, softhsm2, libssl-dev, libmicrohttpd-dev, …)"
"$repo/scripts/install-deps.sh"

step "2/8 Building signerd and signctl (release)"
(cd "$repo" && swift build -c release --product signerd && swift build -c release --product signctl)
bin=$(cd "$repo" && swift build -c release --show-bin-path)
export SIGNCTL=$bin/signctl

demo=${SIGNERD_DEMO_DIR:-$repo/.demo}
mkdir -p "$demo"
demo=$(cd "$demo" && pwd)
step "3/8 Making a SoftHSM token in $demo/hsm (scripts/softhsm-setup.sh)"
token_uri=$("$repo/scripts/softhsm-setup.sh" "$demo/hsm")
export SOFTHSM2_CONF=$demo/hsm/softhsm2.conf
echo "token_uri: $token_uri"

bundle_id=${BUNDLE_ID:-com.example.app}
if [ -n "$p8" ]; then
  step "4/8 Using your key file $p8"
  key_file=$p8
else
  key_file=$demo/SubscriptionKey_DEMO000001.p8
  if [ -s "$key_file" ]; then
    step "4/8 Using the DEMO key generated on an earlier run ($key_file; NOT an App Store key)"
  else
    step "4/8 Generating a DEMO key with openssl (NOT an App Store key; Apple will not accept its signatures)"
    (umask 077 && openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$key_file")
  fi
fi

step "5/8 Importing the key into the token (non-extractable, self-tested)"
# signctl takes the key ID from the file name by the same rule as any
# import (a browser's " (1)" copy and .P8 included) and names it in its
# --json answer: no second rule here. The import needs only token_uri.
import_config=$demo/signctl-import.json
(umask 077 && printf '{"token_uri": "%s"}\n' "$token_uri" > "$import_config")
set +e
imported=$("$bin/signctl" --config "$import_config" keys import --replace --json ${KEY_ID:+--key-id "$KEY_ID"} "$key_file")
status=$?
set -e
rm -f "$import_config"
if [ $status != 0 ]; then
  [ $status = 64 ] && [ -z "${KEY_ID:-}" ] && echo "hint: set KEY_ID=XXXXXXXXXX (the key ID App Store Connect shows for the key) when the file name does not carry it" >&2
  exit $status
fi
field() { python3 -c 'import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"; }
key_id=$(field "$imported" key_id)
echo "imported $key_id into token $(field "$imported" token_label): non-extractable, self-test signature verified"
echo "public key SHA-256 fingerprint: $(field "$imported" fingerprint)"
[ -n "$p8" ] || echo "(the demo key file stays in $demo for the next run: it is no App Store key; delete $demo to start afresh)"
echo "key ID: $key_id, bundle ID: $bundle_id"
# A made-up issuer ID in a JWS signed with a real key gives tokens Apple
# refuses while every answer here is 200: only the demo key gets one.
issuer_line=""
if [ -n "${ISSUER_ID:-}" ]; then
  issuer_line="\"issuer_id\": \"$ISSUER_ID\","
elif [ -z "$p8" ]; then
  issuer_line='"issuer_id": "00000000-0000-4000-8000-000000000000",'
  echo "issuer ID: a placeholder for the demo key (set ISSUER_ID for yours)"
else
  echo "note: no ISSUER_ID given: the JWS kinds answer 400 (key $key_id has no issuer ID) until you set issuer_id in the configuration (App Store Connect → Users and Access → Integrations → In-App Purchase) and reload; the classic signature needs none"
fi

config=$demo/signerd.json
socket=$demo/signerd.sock
cat > "$config.new" <<JSON
{
  "token_uri": "$token_uri",
  "socket_path": "$socket",
  "socket_mode": "0660",
  $issuer_line
  "keys": [{"key_id": "$key_id", "bundle_ids": ["$bundle_id"]}]
}
JSON
if [ -e "$config" ] && ! cmp -s "$config" "$config.new"; then
  mv "$config" "$config.previous"
  echo "note: $config differed from what this run writes (edited, or other variables); the old one is kept as $config.previous"
fi
mv "$config.new" "$config"
echo "configuration: $config"
"$bin/signctl" --config "$config" keys list

step "6/8 Starting signerd on $socket (log: $demo/signerd.log)"
if [ -S "$socket" ] && curl -s --unix-socket "$socket" http://signerd/healthz >/dev/null 2>&1; then
  echo "a signerd from an earlier run is still listening; stopping it"
  [ -f "$demo/signerd.pid" ] && kill "$(cat "$demo/signerd.pid")" 2>/dev/null || true
  sleep 1
fi
"$bin/signerd" --config "$config" 2>"$demo/signerd.log" &
pid=$!
echo $pid > "$demo/signerd.pid"
# Without --keep-running the daemon goes with this script, and so does its
# pid file, which would otherwise name a dead (or later reused) pid.
stop_daemon() {
  if [ $keep_running = 0 ]; then
    kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    rm -f "$demo/signerd.pid"
  fi
  return 0
}
trap stop_daemon EXIT
for _ in $(seq 1 100); do
  curl -s --unix-socket "$socket" http://signerd/healthz >/dev/null 2>&1 && break
  kill -0 "$pid" 2>/dev/null || { echo "error: signerd exited:" >&2; cat "$demo/signerd.log" >&2; exit 69; }
  sleep 0.1
done
"$bin/signctl" --config "$config" health

step "7/8 Requesting a promotional offer signature over the Unix socket (curl)"
request='{"bundle_id": "'$bundle_id'", "product_id": "pro_monthly", "offer_id": "winback_half_price"}'
echo "curl --unix-socket $socket -H 'Content-Type: application/json' -d '$request' http://signerd/v1/sign/promotional-offer"
response=$(curl -sS --fail-with-body --unix-socket "$socket" -H 'Content-Type: application/json' -d "$request" http://signerd/v1/sign/promotional-offer)
echo "$response"
nonce=$(field "$response" nonce); timestamp=$(field "$response" timestamp); signature=$(field "$response" signature); signed_key=$(field "$response" key_id)

step "8/8 Verifying the signature with openssl against the public key exported from the token"
"$bin/signctl" --config "$config" keys export-public "$key_id" > "$demo/public_key.pem"
# The payload Apple verifies: seven values joined by U+2063 (UTF-8 e2 81 a3); the token is empty here.
sep=$'\xe2\x81\xa3'
printf '%s' "$bundle_id$sep$signed_key${sep}pro_monthly${sep}winback_half_price$sep$sep$nonce$sep$timestamp" > "$demo/payload.bin"
printf '%s' "$signature" | base64 -d > "$demo/signature.der"
echo "openssl dgst -sha256 -verify $demo/public_key.pem -signature $demo/signature.der $demo/payload.bin"
openssl dgst -sha256 -verify "$demo/public_key.pem" -signature "$demo/signature.der" "$demo/payload.bin"

echo
if [ $keep_running = 1 ]; then
  trap - EXIT
  echo "signerd keeps running (pid $pid, in $demo/signerd.pid) on $socket."
  echo "Reload $config after editing it: kill -HUP $pid (the log, $demo/signerd.log, says config_reloaded or config_reload_refused)"
  echo "Stop it: kill $pid && rm $demo/signerd.pid"
else
  echo "Done: the token signed, signerd returned the DER signature in standard Base64, and openssl verified it."
fi
echo
echo "To use signctl with this demo (the SoftHSM token lives in $demo/hsm, found through SOFTHSM2_CONF):"
echo "  export SOFTHSM2_CONF=$SOFTHSM2_CONF PATH=$bin:\$PATH"
echo "  signctl --config $config keys list"
echo "  signctl --config $config health        # with the daemon running (--keep-running)"
