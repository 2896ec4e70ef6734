#!/usr/bin/env bash
# Runs signerd's whole test suite: unit tests, SoftHSM token tests, fault
# injection, and the end-to-end tests that start the real signerd binary on
# throw-away SoftHSM tokens. Installs what is missing first
# (scripts/install-deps.sh; skip with SIGNERD_SKIP_DEPS=1). Every token,
# socket and key lives in a temporary directory; the system's SoftHSM tokens
# are never touched. Extra arguments go to `swift test` (e.g. --filter).
#
# Usage: scripts/test.sh [swift test arguments, e.g. --filter AuditLog]
#        scripts/test.sh -h | --help   (this text; swift test's own: swift test --help)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
case "${1:-}" in
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
esac
[ "${SIGNERD_SKIP_DEPS:-0}" = 1 ] || scripts/install-deps.sh
swift build --build-tests
# Every test uses swift-testing. Without --disable-xctest, swift test first
# runs the (empty) XCTest bundle and prints "Executed 0 tests", which reads
# like a failure; should an XCTest test ever be added, XCTest runs again.
xctest=--disable-xctest
if grep -rqs --include='*.swift' '^import XCTest' Tests; then xctest=; fi
# One suite at a time: the suites share one SoftHSM module per process, and
# a recovery test's C_Finalize/C_Initialize (CKR_DEVICE_ERROR, a vanished
# key) would pull it from under a suite running beside it (SIGSEGV inside
# libsofthsm2, seen once in a parallel run). signerd itself opens one token
# per process. Slower than a parallel run (about 6 minutes of tests
# on a 2-core machine), and it does not crash.
swift test --skip-build --no-parallel $xctest "$@"
