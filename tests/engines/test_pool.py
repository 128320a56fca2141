"""The server pool: servers die with their launcher, records end only what they recorded, ports and tokens."""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eaglenest.engines.pool import LaunchError, ServerRecords, free_port, local_server
from eaglenest.engines.server_pool import LaunchSpec, ServerPool

SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan may wait for a reaper that never comes in a container)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not running(pid):
            return True
        time.sleep(0.05)
    return not running(pid)


def test_records_end_a_recorded_server_and_spare_a_recycled_pid(tmp_path):
    records = ServerRecords(tmp_path / "servers.json")
    ours = local_server(SLEEPER, port=free_port(), log_path=tmp_path / "a.log").start()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "other"], start_new_session=True)
    try:
        records.add(ours)
        data = json.loads(records.path.read_text())
        data["servers"].append({"pid": other.pid, "cmd": ["/usr/bin/some-server", "--port", "1"], "url": "x"})
        records.path.write_text(json.dumps(data))  # the pid of a process that runs another command now
        assert records.end_all(grace_s=2) == 1
        assert wait_gone(ours.pid, 5)
        assert running(other.pid)  # never killed on the pid alone
        assert not records.path.exists()
    finally:
        other.kill()
        other.wait()
        ours.stop(grace_s=1)


def test_launcher_refuses_a_port_that_already_serves(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        server = local_server(SLEEPER, port=s.getsockname()[1], log_path=tmp_path / "s.log")
        with pytest.raises(LaunchError, match="already serving before launch"):
            server.start()
    assert server.proc is None  # nothing was started


def test_a_server_answering_with_another_launch_token_is_not_ours(tmp_path):
    port = free_port()
    server = local_server(SLEEPER, port=port, log_path=tmp_path / "s.log").start()

    class Leftover(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"launch_token": "an-earlier-launch"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", port), Leftover)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(LaunchError, match="did not start"):
            server.wait_ready(timeout_s=10, ready=lambda url: True)
    finally:
        httpd.shutdown()
        httpd.server_close()
        server.stop(grace_s=1)


def test_pool_ends_the_servers_a_killed_earlier_run_recorded(tmp_path):
    record = tmp_path / "servers.json"
    stale = local_server(SLEEPER, port=free_port(), log_path=tmp_path / "stale.log").start()
    ServerRecords(record).add(stale)  # as a run killed before its teardown leaves it
    pool = ServerPool(specs=[LaunchSpec("s", lambda port: local_server(SLEEPER, port=port,
                                                                          log_path=tmp_path / "new.log"))],
                      ready=lambda url: True, record_path=record)
    try:
        pool.start()
        assert wait_gone(stale.pid, 10)
        assert ServerRecords(record).pids() == pool.pids()
    finally:
        pool.stop()
        stale.stop(grace_s=1)
    assert not record.exists()


@dataclasses.dataclass
class SlowToStop:
    """A server whose stop lasts until every other server's stop has begun (SGLang's shutdown can take the whole
    grace period): stops one after another never get there, and the barrier breaks."""

    url: str
    barrier: threading.Barrier
    pid: int | None = None
    stopped: bool = False

    def start(self):
        self.pid = os.getpid()
        return self

    def wait_ready(self, *, timeout_s: float, ready) -> None:
        return None

    def alive(self) -> bool:
        return not self.stopped

    def stop(self) -> None:
        self.barrier.wait()
        self.stopped = True


def test_pool_stops_its_servers_side_by_side():
    barrier = threading.Barrier(3, timeout=10)
    pool = ServerPool(specs=[LaunchSpec(n, lambda port: SlowToStop(f"http://127.0.0.1:{port}", barrier))
                             for n in "abc"], ready=lambda url: True)
    pool.start()
    assert len(pool.pids()) == 3
    pool.stop()  # raises BrokenBarrierError when the stops come one after another
    assert pool.pids() == []


def test_a_launched_server_dies_with_its_launcher(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", (
        "import sys, threading, time\n"
        "from pathlib import Path\n"
        "from eaglenest.engines.pool import free_port, local_server\n"
        "def go():\n"  # launched from a thread that ends at once: the server must outlive the thread
        f"    s = local_server({SLEEPER!r}, port=free_port(), log_path=Path({str(tmp_path / 'c.log')!r})).start()\n"
        "    print(s.pid, flush=True)\n"
        "t = threading.Thread(target=go); t.start(); t.join()\n"
        "time.sleep(300)\n")], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    server_pid = int(launcher.stdout.readline())
    time.sleep(0.5)
    assert running(server_pid)  # the launching thread ended; the server did not
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    assert wait_gone(server_pid, 5)


@pytest.mark.timeout(240)
def test_sigkill_of_eaglenest_extract_leaves_no_server(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    cli = subprocess.Popen(
        [sys.executable, "-m", "eaglenest", "extract", "--model", str(tiny_model_dir), "--limit", "60",
         "--max-turns", "1", "--max-tokens", "256", "--output-dir", str(out), "--extraction-id", "k",
         "--batch-size", "4", "--concurrency", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": os.getcwd()})
    record = ServerRecords(out / "k" / "servers.json")
    try:
        deadline = time.monotonic() + 180
        while not record.pids():
            assert cli.poll() is None, "the extraction ended before it launched a server"
            assert time.monotonic() < deadline, "no server launched in 180 s"
            time.sleep(0.1)
        server_pid = record.pids()[0]
        cli.send_signal(signal.SIGKILL)
        cli.wait()
        assert wait_gone(server_pid, 5), "the capture server outlived its killed launcher"
    finally:
        if cli.poll() is None:
            cli.kill()
        record.end_all(grace_s=1)
