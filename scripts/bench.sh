#!/usr/bin/env bash
# signerd benchmark: one run on one machine, side by side, written to docs/BENCHMARKS.md.
#
#   scripts/bench.sh [--duration SECONDS] [--rounds N] [--soak REQUESTS] [--output FILE]
#
# Builds release binaries, makes a throw-away SoftHSM token with one P-256 key,
# and measures with the same closed-loop client (signctl bench):
#   - the direct baseline: SHA-256 + C_SignInit/C_Sign in one process, 8 threads;
#   - signerd at concurrency 8, verify_before_return off and on (default
#     configuration otherwise);
#   - p11-kit server exposing the same token, with the same sign loop running
#     in one client process through p11-kit-client.so, 8 threads;
#   - the floor under any server on these libraries: scripts/mhd-sign-floor.c
#     (libmicrohttpd with a thread per connection, SHA-256, C_SignInit/C_Sign,
#     DER, Base64; no JSON, no checks), driven by the same client as signerd,
#     so that the table shows what the socket and HTTP alone cost here;
#   these five at concurrency 8 are measured in --rounds interleaved rounds
#   (default 3: direct, signerd off, signerd on, p11-kit, then again), because
#   a shared machine's speed drifts between minutes; each target uses the
#   median of the per-round ratios, and every round is printed;
#   - once each: the direct baseline with one thread, and signerd at
#     concurrency 1, 32 and 128 with verify_before_return off and on;
#   - a soak of --soak requests (default 1,000,000) against signerd: RSS at start
#     and end, open descriptors before and after.
# Prints the table and rewrites the measured part of docs/BENCHMARKS.md (between
# the bench:begin/bench:end markers; the notes around them are kept).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
duration=${BENCH_DURATION:-10}
rounds=${BENCH_ROUNDS:-3}
soak=${BENCH_SOAK:-1000000}
output=$repo/docs/BENCHMARKS.md
usage_error() { echo "error: $1" >&2; exit 64; }
while [ $# -gt 0 ]; do
  case $1 in
    --duration|--soak|--rounds|--output)
      [ $# -ge 2 ] || usage_error "$1 needs a value"
      case $1 in --duration) duration=$2 ;; --soak) soak=$2 ;; --rounds) rounds=$2 ;; --output) output=$2 ;; esac
      shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) usage_error "unknown argument $1" ;;
  esac
done
# Checked here, not when the first run (or, for --soak and --output, the
# last step, minutes later) would refuse them: the limits signctl bench takes.
case $rounds in ''|*[!0-9]*|0) usage_error "--rounds must be a whole number, 1 or more; got $rounds" ;; esac
soak_valid() { case $soak in ''|*[!0-9]*|0*) return 1 ;; esac; [ "${#soak}" -le 9 ] && [ "$soak" -le 100000000 ]; }
duration_valid() {
  case $duration in ''|*[!0-9.]*|*.*.*|.) return 1 ;; esac
  awk -v d="$duration" 'BEGIN { exit !(d + 0 > 0 && d + 0 <= 86400) }'
}
soak_valid || usage_error "--soak must be a whole number of requests, 1 to 100000000; got $soak"
duration_valid || usage_error "--duration must be seconds (decimal), more than 0 and at most 86400; got $duration"
output_dir=$(dirname "$output")
[ -d "$output_dir" ] && [ -w "$output_dir" ] || usage_error "--output $output: the directory $output_dir does not exist or is not writable"
[ ! -e "$output" ] || [ -w "$output" ] || usage_error "--output $output is not writable"

echo "==> building release binaries" >&2
(cd "$repo" && swift build -c release --product signerd >&2 && swift build -c release --product signctl >&2)
bin=$(cd "$repo" && swift build -c release --show-bin-path)
export SIGNCTL=$bin/signctl

work=$(mktemp -d /tmp/signerd-bench-XXXXXX)
daemon_pid=""
p11kit_pid=""
client_pid=""
cleanup() {
  # Runs on every exit, errors and signals included; a server that already
  # died must not stop it before the throw-away token (its PIN, the .p8) is removed.
  set +e
  # The client first: a signctl bench left running would go on for its
  # --requests against a socket that is gone (a million failed connects).
  [ -n "$client_pid" ] && kill "$client_pid" 2>/dev/null && wait "$client_pid" 2>/dev/null
  [ -n "$daemon_pid" ] && kill "$daemon_pid" 2>/dev/null && wait "$daemon_pid" 2>/dev/null
  [ -n "$p11kit_pid" ] && kill "$p11kit_pid" 2>/dev/null
  [ -n "${floor_pid:-}" ] && kill "$floor_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
# A signal ends the script through exit, so that cleanup runs; signctl bench
# runs in the background under `wait`, which a signal interrupts at once.
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM

echo "==> throw-away SoftHSM token in $work" >&2
token_uri=$("$repo/scripts/softhsm-setup.sh" "$work/hsm" --label bench)
export SOFTHSM2_CONF=$work/hsm/softhsm2.conf
module=$(printf '%s' "$token_uri" | sed -E 's/.*module-path=([^&]*).*/\1/')
(umask 077 && openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$work/AuthKey_BENCH00001.p8")

write_config() {  # $1 verify_before_return, $2 file, $3 token_uri[, $4 socket_path]
  cat > "$2" <<JSON
{
  "token_uri": "$3",
  "socket_path": "${4:-$work/signerd.sock}",
  "issuer_id": "00000000-0000-4000-8000-000000000000",
  "keys": [{"key_id": "BENCH00001", "bundle_ids": ["com.example.bench"]}],
  "verify_before_return": $1,
  "log_level": "warning"
}
JSON
}
write_config true "$work/verify-on.json" "$token_uri"
write_config false "$work/verify-off.json" "$token_uri"
"$bin/signctl" --config "$work/verify-on.json" keys import "$work/AuthKey_BENCH00001.p8" >&2

start_daemon() {  # $1 config
  "$bin/signerd" --config "$1" 2>>"$work/signerd.log" &
  daemon_pid=$!
  for _ in $(seq 1 100); do
    "$bin/signctl" --config "$1" health >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "error: signerd did not become ready" >&2; cat "$work/signerd.log" >&2; exit 69
}
stop_daemon() {
  kill "$daemon_pid"; wait "$daemon_pid" 2>/dev/null || true; daemon_pid=""
}

results=$work/results
mkdir -p "$results"

# The floor: a C program, built here with the system's C compiler (the Swift
# toolchain's clang will do). Without one its rows are left out, and the
# table says so.
floor_bin=""
floor_cc=$(command -v cc || command -v clang || true)
if [ -n "$floor_cc" ] && "$floor_cc" -O2 "$repo/scripts/mhd-sign-floor.c" -o "$work/mhd-sign-floor" \
     -lmicrohttpd -lcrypto -ldl -lpthread 2>"$work/floor-build.log"; then
  floor_bin=$work/mhd-sign-floor
  write_config false "$work/floor.json" "$token_uri" "$work/floor.sock"
  # It answers GET /v1/keys with signerd's own listing, which signctl bench reads first.
  start_daemon "$work/verify-off.json"
  curl -sf --unix-socket "$work/signerd.sock" http://localhost/v1/keys > "$work/keys.json"
  stop_daemon
else
  echo "note: no C compiler built scripts/mhd-sign-floor.c; the floor rows are left out" >&2
  [ -s "$work/floor-build.log" ] && cat "$work/floor-build.log" >&2
fi
floor_pid=""
floor_up() {
  rm -f "$work/floor.sock"
  "$floor_bin" "$work/floor.sock" "$module" bench BENCH00001 "$work/hsm/pin" "$work/keys.json" 2>>"$work/floor.log" &
  floor_pid=$!
  for _ in $(seq 1 100); do
    [ -S "$work/floor.sock" ] && return 0
    sleep 0.1
  done
  echo "error: the floor did not start" >&2; cat "$work/floor.log" >&2; exit 69
}
floor_down() {
  kill "$floor_pid"; wait "$floor_pid" 2>/dev/null || true; floor_pid=""
}
run() {  # name, config, signctl bench arguments…
  local name=$1 config=$2 status=0; shift 2
  echo "==> $name" >&2
  # The machine's CPU counters around the run (proc(5), the "cpu" line of /proc/stat): the
  # report derives from them how much of the run's time the hypervisor gave to other guests.
  grep -m1 '^cpu ' /proc/stat > "$results/$name.cpu"
  "$bin/signctl" --config "$config" bench --json "$@" > "$results/$name.json" &
  client_pid=$!
  wait "$client_pid" || status=$?
  client_pid=""
  grep -m1 '^cpu ' /proc/stat >> "$results/$name.cpu"
  if [ "$status" != 0 ]; then
    # signctl bench --json reports on stdout: show what it counted, and the servers' last words.
    echo "error: $name: signctl bench exited $status" >&2
    python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); print("  requests %d, errors %s" % (d.get("requests", 0), json.dumps(d.get("errors", {}))))' \
      "$results/$name.json" >&2 2>/dev/null || true
    for log in "$work/signerd.log" "$work/floor.log"; do
      [ -s "$log" ] && { echo "  last lines of $(basename "$log"):" >&2; tail -n 5 "$log" | sed 's/^/    /' >&2; }
    done
    exit 1
  fi
}

p11kit_up() {
  eval "$(p11-kit server --provider "$module" -n "$work/p11kit.sock" "pkcs11:token=bench")"
  p11kit_pid=$P11_KIT_SERVER_PID
}
p11kit_down() {
  kill "$p11kit_pid"; p11kit_pid=""
}
# CPU clock ticks used by a process and its reaped children (proc(5) stat fields 14-17).
process_tree_ticks() {
  awk '{ sub(/.*\) /, ""); print $12 + $13 + $14 + $15 }' "/proc/$1/stat"
}
client_module=$(find /usr/lib -name p11-kit-client.so -path '*pkcs11*' | head -1)
write_config true "$work/p11kit.json" "pkcs11:token=bench?module-path=$client_module&pin-source=file:$work/hsm/pin"

for round in $(seq 1 "$rounds"); do
  echo "==> round $round of $rounds at concurrency 8" >&2
  run "direct-c8-r$round" "$work/verify-on.json" --direct --concurrency 8 --duration "$duration"
  for verify in off on; do
    start_daemon "$work/verify-$verify.json"
    run "signerd-verify-$verify-c8-r$round" "$work/verify-$verify.json" --concurrency 8 --duration "$duration"
    stop_daemon
  done
  if [ -n "$floor_bin" ]; then
    floor_up
    run "floor-c8-r$round" "$work/floor.json" --concurrency 8 --duration "$duration"
    floor_down
  fi
  p11kit_up
  server_ticks_before=$(process_tree_ticks "$p11kit_pid")
  run "p11kit-c8-r$round" "$work/p11kit.json" --direct --concurrency 8 --duration "$duration"
  sleep 0.5  # the server reaps the per-connection child, adding its CPU time to cutime/cstime
  echo $(( $(process_tree_ticks "$p11kit_pid") - server_ticks_before )) > "$results/p11kit-server-ticks-r$round.txt"
  p11kit_down
done

run direct-c1 "$work/verify-on.json" --direct --concurrency 1 --duration "$duration"
for verify in off on; do
  start_daemon "$work/verify-$verify.json"
  for c in 1 32 128; do
    run "signerd-verify-$verify-c$c" "$work/verify-$verify.json" --concurrency "$c" --duration "$duration"
  done
  stop_daemon
done

echo "==> soak: $soak requests through signerd (default configuration, concurrency 8)" >&2
start_daemon "$work/verify-on.json"
run soak "$work/verify-on.json" --concurrency 8 --requests "$soak"
stop_daemon

machine_cpu=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')
machine_cores=$(nproc)
machine_mem=$(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo)
versions="swift $(swift --version 2>/dev/null | head -1 | sed -E 's/.*version ([^ ]+).*/\1/'), SoftHSM $(dpkg-query -W -f='${Version}' softhsm2), p11-kit $(dpkg-query -W -f='${Version}' p11-kit), OpenSSL $(dpkg-query -W -f='${Version}' libssl3), libmicrohttpd $(dpkg-query -W -f='${Version}' libmicrohttpd12), kernel $(uname -r)"
commit=$(cd "$repo" && git rev-parse --short HEAD 2>/dev/null || echo unknown)
# Changes not committed (docs/BENCHMARKS.md aside, which this script writes) are named.
if [ "$commit" != unknown ] && [ -n "$(cd "$repo" && git status --porcelain --untracked-files=no -- . ':(exclude)docs/BENCHMARKS.md')" ]; then
  commit="$commit with uncommitted changes"
fi

python3 - "$results" "$output" "$machine_cpu" "$machine_cores" "$machine_mem" "$versions" "$duration" "$soak" "$commit" "$rounds" <<'PY'
import json, os, sys, datetime, statistics
results, output, cpu, cores, mem, versions, duration, soak, commit, rounds = sys.argv[1:]
rounds = int(rounds)
r = {name[:-5]: json.load(open(os.path.join(results, name))) for name in os.listdir(results) if name.endswith(".json")}
ticks_per_second = os.sysconf("SC_CLK_TCK")
def p11kit_server_cpu(n):
    """p11-kit server's CPU per signature in round n (its per-connection child, reaped), µs."""
    path = os.path.join(results, "p11kit-server-ticks-r%d.txt" % n)
    if not os.path.exists(path): return None
    return int(open(path).read()) * 1e6 / ticks_per_second / max(1, r["p11kit-c8-r%d" % n]["requests"])
def steal(key):
    """Percent of the machine's CPU time during run `key` that the hypervisor gave to other guests
    (proc(5): the 8th value of the "cpu" line, over the sum of the first 8), or None when unknown."""
    path = os.path.join(results, key + ".cpu")
    try:
        before, after = [[int(v) for v in line.split()[1:9]] for line in open(path).read().splitlines()[:2]]
    except (OSError, ValueError):
        return None
    total = sum(after) - sum(before)
    return (after[7] - before[7]) * 100.0 / total if total > 0 else None
def rps(key): return r[key]["throughput_rps"]
def per_round(kind): return ["%s-r%d" % (kind, n) for n in range(1, rounds + 1)]
def median_round(kind):
    """The round whose throughput is the median (the lower middle one for an even count)."""
    keys = sorted(per_round(kind), key=rps)
    return keys[(len(keys) - 1) // 2]
# Every "median" here is a run or a round's ratio, never the mean of two: for
# an even count, the lower of the two middle ones (statistics.median_low).
base = rps(median_round("direct-c8"))
def row(label, key):
    x = r[key]; l = x["latency_ms"]
    errors = sum(x["errors"].values())
    rss = x.get("rss_kib") or {}
    return "| %s | %d | %.0f | %.2f | %.3f | %.3f | %.3f | %.3f | %.3f | %d | %s |" % (
        label, x["concurrency"], x["throughput_rps"], x["throughput_rps"] / base,
        l.get("p50", 0), l.get("p90", 0), l.get("p99", 0), l.get("p99.9", 0), l.get("max", 0), errors,
        ("%.1f" % (rss["after"] / 1024)) if rss else "–")
lines = []
lines.append("Measured %s UTC on %s (%s cores, %s), commit %s." % (datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"), cpu, cores, mem, commit))
lines.append("")
lines.append("Versions: %s." % versions)
lines.append("")
lines.append("Command: `scripts/bench.sh --duration %s --rounds %d --soak %s` (client and daemon on the same machine; every run %s s, closed loop, keep-alive connections)." % (duration, rounds, soak, duration))
lines.append("")
lines.append("Rows at concurrency 8 are the median of %d interleaved rounds%s; × baseline is against the median direct run (%.0f signatures/s)."
             % (rounds, " (of an even count, the lower of the two middle ones)" if rounds % 2 == 0 else "", base))
lines.append("")
# Steal time: on a virtual machine the host may run other guests on these cores; a run that lost
# much of its time that way measures the neighbours as well as the servers.
stolen = {k: steal(k) for k in r}
stolen = {k: v for k, v in stolen.items() if v is not None}
if stolen:
    worst = max(stolen, key=stolen.get)
    lines.append("CPU steal (time the hypervisor gave these cores to other guests, from /proc/stat) was %.1f %% over the runs' median and %.1f %% at most (%s); "
                 "where a round's steal is high its ratios say more about the neighbours than about the servers." % (statistics.median(stolen.values()), stolen[worst], worst))
    lines.append("")
lines.append("| run | concurrency | signatures/s | × baseline | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | errors | daemon RSS after, MiB |")
lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
lines.append(row("direct PKCS#11 baseline", median_round("direct-c8")))
lines.append(row("direct PKCS#11, one thread", "direct-c1"))
for v in ["off", "on"]:
    for c in [1, 8, 32, 128]:
        key = median_round("signerd-verify-%s-c8" % v) if c == 8 else "signerd-verify-%s-c%d" % (v, c)
        lines.append(row("signerd, verify_before_return %s" % v, key))
lines.append(row("p11-kit server + p11-kit-client.so", median_round("p11kit-c8")))
floor = all(("floor-c8-r%d" % n) in r for n in range(1, rounds + 1))
if floor:
    lines.append(row("C floor: libmicrohttpd + PKCS#11, no request checks", median_round("floor-c8")))
lines.append("")
# Ratios pair the runs of one round (minutes apart at most), then take the median over rounds.
rows = []
for n in range(1, rounds + 1):
    direct = r["direct-c8-r%d" % n]; off = r["signerd-verify-off-c8-r%d" % n]; on = r["signerd-verify-on-c8-r%d" % n]; p11 = r["p11kit-c8-r%d" % n]
    mean = direct["latency_ms"]["mean"]  # ms per signature per thread
    rows.append({"direct": direct["throughput_rps"], "off": off["throughput_rps"], "on": on["throughput_rps"], "p11": p11["throughput_rps"],
                 "p99": off["latency_ms"]["p99"], "allowed": 2 * mean + 1})
for x in rows:
    x["off/direct"] = x["off"] / x["direct"]; x["on/direct"] = x["on"] / x["direct"]; x["off/p11"] = x["off"] / x["p11"]
def round_steal(n):
    """The highest steal of round n's runs at concurrency 8, as table text."""
    values = [v for v in (stolen.get("%s-c8-r%d" % (k, n)) for k in ("direct", "signerd-verify-off", "signerd-verify-on", "p11kit", "floor")) if v is not None]
    return "%.1f" % max(values) if values else "–"
lines.append("| round | direct c=8 | signerd off c=8 | signerd on c=8 | p11-kit c=8 | off / direct | on / direct | off / p11-kit | p99 off c=8 vs allowed, ms | highest CPU steal, % |")
lines.append("|---|---|---|---|---|---|---|---|---|---|")
for n, x in enumerate(rows, 1):
    lines.append("| %d | %.0f | %.0f | %.0f | %.0f | %.2f | %.2f | %.2f | %.2f vs %.2f | %s |" % (n, x["direct"], x["off"], x["on"], x["p11"], x["off/direct"], x["on/direct"], x["off/p11"], x["p99"], x["allowed"], round_steal(n)))
lines.append("")
# CPU per request from the same runs: what each side spent, and the ratio signerd could reach at best if
# the daemon spent exactly one direct signature's CPU per request (client and daemon share the cores).
def cpu(key, side): return (r[key].get("cpu_us_per_request") or {}).get(side)
lines.append("CPU time per request in the same runs (µs, user + system; getrusage for signctl and the p11-kit client, /proc/PID/stat for signerd and for the p11-kit server with its reaped per-connection child). "
             "The last column is direct ÷ (direct + client, verify off): the ratio signerd would reach if its daemon spent no more CPU per request than the direct loop spends per signature.")
lines.append("")
lines.append("| round | direct, per signature | signerd off: daemon + client | signerd on: daemon + client | p11-kit: server + client | bound for off / direct |")
lines.append("|---|---|---|---|---|---|")
for n in range(1, rounds + 1):
    d = cpu("direct-c8-r%d" % n, "signctl"); p = cpu("p11kit-c8-r%d" % n, "signctl"); ps = p11kit_server_cpu(n)
    od, oc = cpu("signerd-verify-off-c8-r%d" % n, "signerd"), cpu("signerd-verify-off-c8-r%d" % n, "signctl")
    vd, vc = cpu("signerd-verify-on-c8-r%d" % n, "signerd"), cpu("signerd-verify-on-c8-r%d" % n, "signctl")
    if None in (d, p, ps, od, oc, vd, vc):
        lines.append("| %d | (CPU time not readable) | | | | |" % n); continue
    lines.append("| %d | %.0f | %.0f + %.0f | %.0f + %.0f | %.0f + %.0f | %.2f |" % (n, d, od, oc, vd, vc, ps, p, d / (d + oc)))
lines.append("")
def med(key): return statistics.median_low(x[key] for x in rows)
def held(test): return "%d of %d rounds" % (sum(1 for x in rows if test(x)), rounds)
def rss_after(key): return (r[key].get("rss_kib") or {}).get("after", float("nan"))
rss128 = max(rss_after("signerd-verify-off-c128"), rss_after("signerd-verify-on-c128")) / 1024
s = r["soak"]
soak_rss = s.get("rss_kib") or {}
soak_before, soak_after = soak_rss.get("before", float("nan")), soak_rss.get("after", float("nan"))
growth = (soak_after - soak_before) / soak_before * 100 if soak_before == soak_before and soak_before else float("nan")
def verdict(ok): return "met" if ok else "**missed**"
if floor:
    # The floor (scripts/mhd-sign-floor.c) does only what a signature over this socket must: it shows what the
    # client, the socket and libmicrohttpd cost on this machine, apart from signerd's own request path.
    lines.append("The C floor (`scripts/mhd-sign-floor.c`) is a server on the same libraries that does only what a signature over this socket must: "
                 "libmicrohttpd with a thread per connection, SHA-256 over the body, `C_SignInit`/`C_Sign`, DER, Base64. It parses no JSON and checks nothing, "
                 "so it is not a server anyone should run; driven by the same client in the same rounds, it shows what the socket and HTTP alone cost on this machine. "
                 "Its CPU is read the same way as signerd's.")
    lines.append("")
    lines.append("| round | floor c=8 | floor / direct | signerd off / floor | floor / p11-kit | floor p99 vs allowed, ms | CPU per request, floor: server + client | signerd off: daemon + client |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for n, x in enumerate(rows, 1):
        f = r["floor-c8-r%d" % n]
        fd, fc = cpu("floor-c8-r%d" % n, "signerd"), cpu("floor-c8-r%d" % n, "signctl")
        od, oc = cpu("signerd-verify-off-c8-r%d" % n, "signerd"), cpu("signerd-verify-off-c8-r%d" % n, "signctl")
        cpu_text = "%.0f + %.0f | %.0f + %.0f" % (fd, fc, od, oc) if None not in (fd, fc, od, oc) else "– | –"
        lines.append("| %d | %.0f | %.2f | %.2f | %.2f | %.2f vs %.2f | %s |" % (
            n, f["throughput_rps"], f["throughput_rps"] / x["direct"], x["off"] / f["throughput_rps"], f["throughput_rps"] / x["p11"],
            f["latency_ms"]["p99"], x["allowed"], cpu_text))
    lines.append("")
else:
    lines.append("The C floor was not measured: no C compiler built `scripts/mhd-sign-floor.c`.")
    lines.append("")
lines.append("| target | measured (median of rounds) | |")
lines.append("|---|---|---|")
lines.append("| signerd c=8, verify off ≥ 0.85 × direct c=8 | %.2f × (held in %s) | %s |" % (med("off/direct"), held(lambda x: x["off/direct"] >= 0.85), verdict(med("off/direct") >= 0.85)))
lines.append("| signerd c=8, verify on ≥ 0.5 × direct c=8 | %.2f × (held in %s; verification costs %.0f %%) | %s |" % (med("on/direct"), held(lambda x: x["on/direct"] >= 0.5), (1 - med("on") / med("off")) * 100, verdict(med("on/direct") >= 0.5)))
lines.append("| signerd c=8 ≥ 1.3 × p11-kit server c=8 | %.2f × (held in %s) | %s |" % (med("off/p11"), held(lambda x: x["off/p11"] >= 1.3), verdict(med("off/p11") >= 1.3)))
p99_ok = lambda x: x["p99"] <= x["allowed"]
lines.append("| p99 at c=8 ≤ 2 × baseline mean per signature + 1 ms | %.2f ms vs %.2f ms (held in %s) | %s |" % (med("p99"), med("allowed"), held(p99_ok), verdict(med("p99") <= med("allowed"))))
lines.append("| daemon RSS ≤ 40 MiB at c=128 | %.1f MiB | %s |" % (rss128, verdict(rss128 <= 40)))
# signerd is not dumpable: only root may list /proc/PID/fd, and signctl then leaves the counts out.
fds = s.get("open_fds") or {}
if "before" in fds and "after" in fds:
    fds_text, fds_ok = "descriptors %d → %d" % (fds["before"], fds["after"]), fds["after"] <= fds["before"]
else:
    fds_text, fds_ok = "descriptors not readable (run as root to count them)", False
lines.append("| soak of %d requests: RSS growth ≤ 5 %%, no descriptor left over | RSS %.1f → %.1f MiB (%+.1f %%), %s, %d errors, %.0f signatures/s | %s |" % (
    s["requests"], soak_before / 1024, soak_after / 1024, growth, fds_text, sum(s["errors"].values()), s["throughput_rps"],
    verdict(growth <= 5 and fds_ok) if "before" in fds and "after" in fds else "not measured"))
block = "\n".join(lines)
print(block)
begin, end = "<!-- bench:begin -->", "<!-- bench:end -->"
text = open(output).read() if os.path.exists(output) else "# Benchmarks\n\n%s\n%s\n" % (begin, end)
if begin not in text:
    text += "\n%s\n%s\n" % (begin, end)
head, rest = text.split(begin, 1)
tail = rest.split(end, 1)[1]
open(output, "w").write(head + begin + "\n" + block + "\n" + end + tail)
print("\nwrote " + output, file=sys.stderr)
PY
