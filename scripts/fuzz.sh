#!/usr/bin/env bash
# signerd fuzzing with libFuzzer: builds signerd-fuzz with libFuzzer's
# coverage instrumentation and runs one or all of its targets for a while.
#
#   scripts/fuzz.sh [--asan] [--seconds N] [--jobs N] [handle|preflight|misc|all] [-- libFuzzer options]
#
# Targets (Sources/signerd-fuzz; docs/FUZZING.md):
#   handle     SignerService.handle: every endpoint, body and field rule, signing on a SoftHSM token
#   preflight  SignerService.preflight: the answers made from the request head alone
#   misc       configuration, DER/raw signatures, RFC 7512 URIs, JWS, base64url,
#              Apple's field rules, key files, command-line arguments, request bodies
# Each starts from Tests/FuzzCorpus/<target> (read only) with its dictionary and
# writes what it finds to .build/fuzz-work/<target>/: new inputs in corpus/,
# crashes, timeouts and slow inputs in artifacts/. A crash, a broken invariant
# (FUZZ_STRICT=1 is set, so a 500 is one, as in the test suite's replay) or an
# input that runs longer than the per-input timeout stops the run with
# libFuzzer's report and exit status; copy the input into
# Tests/FuzzCorpus/<target> with the fix, and the test suite replays it from
# then on.
#   --seconds N  time per target (default 60)
#   --asan       AddressSanitizer as well as coverage (-sanitize=fuzzer,address;
#                a separate build directory, .build/fuzz-asan; slower). Leaks
#                are reported, less those listed in scripts/fuzz-lsan.supp
#                (LSAN_OPTIONS=suppressions=…)
#   --jobs N     parallel fuzzing processes per target (default 1). Above 1,
#                libFuzzer runs them as -jobs=N -workers=N, each writing its
#                log to .build/fuzz-work/<target>/fuzz-K.log, and the run's
#                status is 1 whatever stopped a job; with 1, the report goes
#                to the terminal and the status is the fuzzer's own
# libFuzzer options the script sets: -timeout=10 (seconds per input),
# -report_slow_units=1 (an input slower than 1 s is saved as slow-unit-*),
# -max_total_time, -dict, -artifact_prefix, -print_final_stats=1. Options
# after -- come later on the command line, so they win (-timeout=2).
# Needs the Swift toolchain (its compiler-rt has libFuzzer and the sanitizers)
# and what scripts/install-deps.sh installs; a SoftHSM token is made by the
# target itself.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
seconds=60 jobs=1 asan=0 targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --seconds) [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || { echo "error: --seconds needs a whole number of seconds" >&2; exit 64; }; seconds=$2; shift 2 ;;
    --jobs) [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || { echo "error: --jobs needs a whole number" >&2; exit 64; }; jobs=$2; shift 2 ;;
    --asan) asan=1; shift ;;
    handle|preflight|misc) targets+=("$1"); shift ;;
    all) targets+=(handle preflight misc); shift ;;
    --) shift; break ;;
    *) echo "error: unknown argument '$1'" >&2; echo "hint: scripts/fuzz.sh --help" >&2; exit 64 ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(handle preflight misc)

# Sanitizers. For one, SwiftPM's --sanitize is enough. For two
# (--sanitize=fuzzer --sanitize=address), SwiftPM hands swiftc one -sanitize=
# flag each, in an order that changes from one run to the next, and swiftc
# keeps only the last: a build had either coverage without AddressSanitizer
# in the Swift code, or AddressSanitizer without coverage (libFuzzer then
# sees 2 or 3 edges and fuzzes blind). So --asan keeps --sanitize=fuzzer
# (SwiftPM then links libFuzzer's main instead of the replayer's) and adds
# one combined -sanitize=fuzzer,address, which comes after SwiftPM's own
# flag on every swiftc command line, compiling and linking, and so is the
# one kept; clang, for the C shim, adds up its -fsanitize flags. The Swift
# objects are checked for both kinds of calls after the build.
scratch=$repo/.build/fuzz sanitizers=(--sanitize=fuzzer)
if [ "$asan" = 1 ]; then
  scratch=$repo/.build/fuzz-asan
  sanitizers+=(-Xswiftc -sanitize=fuzzer,address -Xcc -fsanitize=address)
fi
build=(swift build -c release "${sanitizers[@]}" -Xswiftc -DSIGNERD_LIBFUZZER --product signerd-fuzz --scratch-path "$scratch")
echo "==> ${build[*]}" >&2
(cd "$repo" && "${build[@]}" >&2)
bin=$(cd "$repo" && swift build -c release --scratch-path "$scratch" --show-bin-path)
fuzzer=$bin/signerd-fuzz
if [ "$asan" = 1 ]; then
  # The request path's Swift objects must call both: ASan's checks and libFuzzer's coverage hooks.
  undefined=$(nm -u "$bin"/SignerIPC.build/*.o)
  for hook in __asan_report_ __sanitizer_cov_; do
    grep -q "$hook" <<<"$undefined" || { echo "error: SignerIPC was built without $hook* calls: the sanitizer flags did not reach swiftc" >&2; exit 70; }
  done
fi

# The targets' invariants as the test suite's replay checks them: a 500 is a failure.
export FUZZ_STRICT=1
if [ "$asan" = 1 ]; then
  # Leaks the target does not own (the Swift runtime's weak-reference side
  # table behind Foundation's Process.run; see the file) are suppressed by name.
  export LSAN_OPTIONS="suppressions=$repo/scripts/fuzz-lsan.supp${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
fi
parallel=()
# Only above 1: -jobs sends even one job's report to fuzz-0.log and makes the status 1.
if [ "$jobs" -gt 1 ]; then parallel=(-jobs="$jobs" -workers="$jobs"); fi

status=0
for target in "${targets[@]}"; do
  work=$repo/.build/fuzz-work/$target
  mkdir -p "$work/corpus" "$work/artifacts"
  echo "==> $target for $seconds s: new inputs in $work/corpus, crashes in $work/artifacts" >&2
  # With --jobs above 1, libFuzzer writes its workers' logs (fuzz-N.log) into the current directory.
  (cd "$work" && "$fuzzer" "$target" -max_total_time="$seconds" "${parallel[@]}" -timeout=10 -report_slow_units=1 \
    -dict="$repo/Tests/FuzzCorpus/$target.dict" -artifact_prefix="$work/artifacts/" \
    -print_final_stats=1 "$@" "$work/corpus" "$repo/Tests/FuzzCorpus/$target") || {
    status=$?
    echo "error: $target stopped with status $status; the input is in $work/artifacts" >&2
    if [ ${#parallel[@]} -gt 0 ]; then echo "hint: the jobs' reports are in $work/fuzz-*.log" >&2; fi
    break
  }
done
exit $status
