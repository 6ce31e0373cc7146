"""A peer the benchmark starts gets the user's environment, not the one pagoda loaded torch with."""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys

import pytest

from pagoda.bench.serve.peer import peer_process
from pagoda.core import machine

PEER = """
import http.server, json, os, sys
open(sys.argv[2], "w").write(json.dumps({"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")}))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_started_peer_inherits_the_users_environment(tmp_path):
    if os.environ.get(machine.WAIT_POLICY_ENV) is not None:
        pytest.skip("the user set OMP_WAIT_POLICY: a peer inherits it, as it should")
    assert machine.STATE.wait_policy == machine.PASSIVE  # torch here runs with sleeping OpenMP threads...
    script, seen, port = tmp_path / "peer.py", tmp_path / "env.json", free_port()
    script.write_text(PEER)
    command = f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} {port} {shlex.quote(str(seen))}"
    with peer_process(command, f"http://127.0.0.1:{port}", ready_timeout=60, poll_s=0.05):
        env = json.loads(seen.read_text())
    assert env == {"OMP_WAIT_POLICY": None}  # ...and the peer sees none of it (llama-server: 37 tok/s with it)
