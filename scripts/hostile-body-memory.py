#!/usr/bin/env python3
"""Peak memory of a running signerd while clients send hostile bodies.

    scripts/hostile-body-memory.py SOCKET PID [--clients 32] [--requests 20]

Each client thread sends --requests bodies of about 64 KB (signerd's default
max_body_bytes) to POST /v1/sign/promotional-offer, one per connection: a
request whose unknown member "x" holds about 8,000 small objects, so that the
daemon reads the whole body before it answers 400 unknown_field. Prints one
JSON line: the answers by status, the daemon's VmHWM before and after (KiB,
from /proc/PID/status; VmHWM is the process's peak, so use a fresh daemon)
and the wall time. docs/BENCHMARKS.md (twenty-second round) quotes it.
"""
import argparse, json, socket, threading, time

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("socket")
parser.add_argument("pid")
parser.add_argument("--clients", type=int, default=32)
parser.add_argument("--requests", type=int, default=20)
args = parser.parse_args()

objects = ",".join(['{"a":0}'] * 8000)
body = ('{"bundle_id":"com.example.bench","product_id":"p","offer_id":"o",'
        '"app_account_token":"","x":[' + objects + ']}').encode()
request = (b"POST /v1/sign/promotional-offer HTTP/1.1\r\nHost: signerd\r\n"
           b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body

def status(field):
    with open("/proc/%s/status" % args.pid) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])

answers, lock = {}, threading.Lock()

def client():
    for _ in range(args.requests):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(args.socket)
            s.sendall(request)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = s.recv(65536)
                if not chunk:
                    break
                head += chunk
            code = head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/") else "no answer"
            with lock:
                answers[code] = answers.get(code, 0) + 1

before = status("VmHWM")
start = time.monotonic()
threads = [threading.Thread(target=client) for _ in range(args.clients)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps({"body_bytes": len(body), "answers": answers, "VmHWM_before_kib": before,
                  "VmHWM_after_kib": status("VmHWM"), "seconds": round(time.monotonic() - start, 2)}))
