#!/usr/bin/env bash
# Installs what signerd builds and tests with on Debian 12 (bookworm): the
# four -dev libraries it links (p11-kit, OpenSSL's libcrypto, libmicrohttpd),
# SoftHSM, the p11-kit, openssl and curl tools, and PyJWT + cryptography from
# PyPI for the tests' independent JWT check. Runs `apt-get update` once, and
# only when a package is missing.
set -euo pipefail
sudo=""
[ "$(id -u)" = 0 ] || sudo=sudo
packages="libp11-kit-dev p11-kit softhsm2 libssl-dev openssl libmicrohttpd-dev pkg-config curl python3"
python3 -m pip --version >/dev/null 2>&1 || packages="$packages python3-pip"
missing=""
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
# A python3 outside Debian's (pyenv) counts as installed.
if command -v python3 >/dev/null 2>&1; then missing=${missing/ python3 / }; missing=${missing% python3}; fi
if [ -z "${missing// /}" ]; then
  echo "all Debian packages present: $packages" >&2
else
  echo "installing:$missing" >&2
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing
fi
if python3 -c 'import jwt, cryptography' 2>/dev/null; then
  echo "PyJWT and cryptography present" >&2
else
  echo "installing PyJWT and cryptography from PyPI" >&2
  python3 -m pip install --quiet PyJWT cryptography 2>/dev/null \
    || python3 -m pip install --quiet --break-system-packages PyJWT cryptography
fi
