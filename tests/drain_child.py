"""A stand-in for the vLLM server under `bidir-kv serve` (tests/test_launcher.py): it
answers POST /bidirkv/residency with the JSON in REPORT_FILE (re-read on each call),
records each call's body and each signal it gets in LOG_FILE, and exits with EXIT_CODE
on SIGTERM (or SIGINT)."""

import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REPORT, LOG, PORT = sys.argv[1], sys.argv[2], int(sys.argv[3])
EXIT_CODE = int(sys.argv[4]) if len(sys.argv) > 4 else 0


def note(line):
    with open(LOG, "a") as f:
        f.write(line + "\n")


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        note("call " + body.decode())
        with open(REPORT) as f:
            out = f.read().encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", PORT), Handler)


def stop(signum, _frame):
    note(f"signal {signal.Signals(signum).name}")
    threading.Thread(target=server.shutdown).start()


signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
note(f"ready {os.getpid()}")
server.serve_forever()
sys.exit(EXIT_CODE)
