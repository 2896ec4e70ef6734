#!/usr/bin/env bash
# Runs signerd's whole test suite: unit tests, SoftHSM token tests, and the
# end-to-end tests that start the real signerd binary on a throw-away SoftHSM
# token. Needs the packages .ci/run installs (scripts/install-deps.sh).
# Every token, socket and key lives in a temporary directory; the system's
# SoftHSM tokens are never touched.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
swift build --build-tests
swift test --skip-build "$@"
