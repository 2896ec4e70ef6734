#!/usr/bin/env bash
# Create (or find again) a SoftHSM token for signerd in a directory of its own.
#
#   scripts/softhsm-setup.sh DIR [--label LABEL]
#
# DIR gets its own softhsm2.conf and tokens/ (the system's tokens are never
# touched), a random user PIN in DIR/pin and a random SO PIN in DIR/so-pin,
# both mode 0600 and never on a command line. Prints the token_uri to put in
# signerd.json on stdout; everything else goes to stderr. Running it again
# changes nothing and prints the same URI.
#
# Environment: SIGNCTL (path to signctl; default: on PATH, else this
# checkout's .build/{release,debug}/signctl, built if missing),
# SOFTHSM_MODULE (default: Debian's libsofthsm2.so).
set -euo pipefail

usage() { echo "usage: $0 DIR [--label LABEL]" >&2; exit 64; }
show_help() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 0; }
[ $# -ge 1 ] || usage
case $1 in -h|--help) show_help ;; -*) usage ;; esac
dir=$1; shift
label=signer
while [ $# -gt 0 ]; do
  case $1 in
    --label) [ $# -ge 2 ] || usage; label=$2; shift 2 ;;
    -h|--help) show_help ;;
    *) usage ;;
  esac
done

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
module=${SOFTHSM_MODULE:-}
if [ -z "$module" ]; then
  for candidate in /usr/lib/softhsm/libsofthsm2.so /usr/lib/x86_64-linux-gnu/softhsm/libsofthsm2.so /usr/lib/aarch64-linux-gnu/softhsm/libsofthsm2.so; do
    [ -e "$candidate" ] && { module=$candidate; break; }
  done
fi
[ -n "$module" ] && [ -e "$module" ] || { echo "error: libsofthsm2.so not found; install softhsm2 (apt-get install softhsm2) or set SOFTHSM_MODULE" >&2; exit 69; }

signctl=${SIGNCTL:-}
if [ -z "$signctl" ]; then
  if command -v signctl >/dev/null 2>&1; then signctl=$(command -v signctl)
  elif [ -x "$repo/.build/release/signctl" ]; then signctl=$repo/.build/release/signctl
  elif [ -x "$repo/.build/debug/signctl" ]; then signctl=$repo/.build/debug/signctl
  else
    echo "building signctl…" >&2
    (cd "$repo" && swift build -c release --product signctl >&2)
    signctl=$repo/.build/release/signctl
  fi
fi

umask 077
mkdir -p "$dir/tokens"
dir=$(cd "$dir" && pwd)
chmod 0700 "$dir"
conf=$dir/softhsm2.conf
cat > "$conf.tmp" <<CONF
# SoftHSM configuration for signerd (written by scripts/softhsm-setup.sh)
directories.tokendir = $dir/tokens
objectstore.backend = file
log.level = ERROR
slots.removable = false
CONF
mv "$conf.tmp" "$conf"

# Random PINs straight into 0600 files: never in argv or the environment.
[ -s "$dir/pin" ] || openssl rand -hex 16 > "$dir/pin"
[ -s "$dir/so-pin" ] || openssl rand -hex 16 > "$dir/so-pin"
chmod 0600 "$dir/pin" "$dir/so-pin"

# A token directory whose token.object is empty or gone was cut short while
# SoftHSM rewrote it (a process ended mid-write, a full disk): SoftHSM then
# counts it as a free slot, and token init would make a new, empty token
# beside it, hiding the damage.
for token_dir in "$dir"/tokens/*/; do
  [ -d "$token_dir" ] || continue
  if [ ! -s "$token_dir/token.object" ]; then
    echo "error: ${token_dir%/} holds a SoftHSM token whose token.object is empty or missing: it was cut short while written (a process ended mid-write, a full disk); restore that directory from your copy, or move it away to start afresh (its keys are lost)" >&2
    exit 65
  fi
done
# One cut short but not empty: SoftHSM reads fewer tokens than there are
# directories (counted as above: hidden ones are not tokens).
token_dirs=0
for token_dir in "$dir"/tokens/*/; do
  if [ -d "$token_dir" ]; then token_dirs=$((token_dirs + 1)); fi
done
slots=""
if [ "$token_dirs" -gt 0 ] && command -v softhsm2-util >/dev/null 2>&1; then
  slots=$(SOFTHSM2_CONF=$conf softhsm2-util --module "$module" --show-slots 2>/dev/null) \
    || echo "warning: softhsm2-util --show-slots failed; the token directories in $dir/tokens were not checked" >&2
fi
if [ -n "$slots" ]; then
  readable=$(printf '%s\n' "$slots" | grep -c 'Initialized: *yes' || true)
  if [ "$readable" -lt "$token_dirs" ]; then
    echo "error: $dir/tokens holds $token_dirs token directories, but SoftHSM reads only $readable tokens there: a token.object was cut short while written (a process ended mid-write, a full disk, a file size limit); restore the token directories from your copy, or move the damaged one away to start afresh (its keys are lost)" >&2
    exit 65
  fi
fi

SOFTHSM2_CONF=$conf "$signctl" token init --label "$label" --module "$module" \
  --pin-file "$dir/pin" --so-pin-file "$dir/so-pin" >&2

echo "SoftHSM token '$label' is ready in $dir. signerd and signctl need: export SOFTHSM2_CONF=$conf" >&2
echo "pkcs11:token=$label?module-path=$module&pin-source=file:$dir/pin"
