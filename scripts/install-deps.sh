#!/usr/bin/env bash
# Installs what signerd builds and tests with on Debian 12 (bookworm):
# the four -dev libraries it links, SoftHSM, the p11-kit and openssl tools,
# and the Python packages its independent JWT check uses.
set -euo pipefail
sudo=""
[ "$(id -u)" = 0 ] || sudo=sudo
packages="libp11-kit-dev p11-kit softhsm2 libssl-dev openssl libmicrohttpd-dev pkg-config curl python3 python3-pip"
missing=""
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "installing:$missing" >&2
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing
fi
