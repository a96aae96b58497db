"""The metadata emulator answers directories as the real server does, since google-guest-agent
(the bench's peer) relies on it: ``//`` read as ``/``, ``?recursive=true`` as nested JSON, and
directory long-polls that wait until something under the directory changes. A stopped emulator
stays "down" for its tests while others run at once."""

from __future__ import annotations

import errno
import json
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from harness import mds_emulator
from harness.mds_emulator import MetadataEmulator, nested
from tests.unit.helpers.runproc import started

#: The notice keys of a VM nothing is happening to, which every emulated instance holds.
QUIET_NOTICES = {"maintenance-event": "NONE", "preempted": "FALSE"}


def get(emulator: MetadataEmulator, query: str, timeout: float = 5.0) -> tuple[str, str]:
    request = urllib.request.Request(emulator.url + query, headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return answer.read().decode(), answer.headers["ETag"]


def test_nested_makes_one_object_per_directory() -> None:
    assert nested({"instance/id": "1", "instance/attributes/k": "v", "project/x": "y"}) == {
        "instance": {"attributes": {"k": "v"}, "id": "1"},
        "project": {"x": "y"},
    }


def test_a_stopped_emulator_refuses_and_keeps_its_port_from_every_other_socket() -> None:
    """A stopped server's port, free, is the next bind(0) of any test running beside (another
    xdist worker, another matrix row), whose server then answers in its place: seen as a wrong
    answer in the jammy row. Held bound, it refuses a connect, and no bind takes it but restart's."""
    with MetadataEmulator({"k": "v"}) as emulator:
        port = emulator.port
        emulator.stop()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        taken = set()
        for _ in range(3000):
            with socket.socket() as other:
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                other.bind(("127.0.0.1", 0))
                taken.add(other.getsockname()[1])
        assert port not in taken
        with socket.socket() as plain, pytest.raises(OSError) as refused:
            plain.bind(("127.0.0.1", port))
        assert refused.value.errno == errno.EADDRINUSE
        emulator.restart()
        assert (emulator.port, get(emulator, "instance/attributes/k")[0]) == (port, "v")
    unused = MetadataEmulator().start()  # no connection, so no TIME_WAIT on its port after
    unused.stop()
    unused.close()
    with socket.socket() as plain:
        plain.bind(("127.0.0.1", unused.port))  # given back at close


def test_recursive_directories_are_nested_json_and_double_slashes_are_one() -> None:
    with MetadataEmulator({"k": "v"}, instance={"id": "7"}) as emulator:
        body, etag = get(emulator, "?recursive=true&alt=json")
        assert json.loads(body) == {"instance": {"attributes": {"k": "v"}, "id": "7", **QUIET_NOTICES}}
        assert get(emulator, "/?recursive=true&alt=json") == (body, etag)  # the guest agent's ".../v1//"
        assert json.loads(get(emulator, "instance//attributes/?recursive=true")[0]) == {"k": "v"}
        assert get(emulator, "instance//attributes//k")[0] == "v"
        assert get(emulator, "instance/")[0] == "attributes/\nid\nmaintenance-event\npreempted\n"  # a listing


def test_a_directory_long_poll_waits_for_a_change_under_it() -> None:
    with MetadataEmulator({"k": "v"}, instance={"id": "7"}) as emulator:
        _, etag = get(emulator, "?recursive=true")
        # Behind (an old etag): at once.
        assert get(emulator, "?recursive=true&wait_for_change=true&last_etag=old")[1] == etag
        box: dict[str, tuple[str, str]] = {}

        def poll(name: str, query: str) -> threading.Thread:
            thread = threading.Thread(target=lambda: box.update({name: get(emulator, query, timeout=30)}))
            thread.start()
            return thread

        root = poll("root", f"?recursive=true&wait_for_change=true&last_etag={etag}&timeout_sec=30")
        assert emulator.wait_for_pollers(1), "a directory long-poll with the current etag answered at once"
        instance = poll("instance", "instance/?recursive=true&wait_for_change=true&timeout_sec=30")
        assert emulator.wait_for_pollers(2)
        emulator.set("project/attributes/elsewhere", "x")  # under the root, not under instance/
        root.join(10)
        assert not root.is_alive()
        assert json.loads(box["root"][0])["project"] == {"attributes": {"elsewhere": "x"}}
        instance.join(0.5)
        assert instance.is_alive(), "a change outside instance/ woke its long-poll"
        emulator.set_attribute("k", "w")
        instance.join(10)
        assert not instance.is_alive()
        assert json.loads(box["instance"][0]) == {"attributes": {"k": "w"}, "id": "7", **QUIET_NOTICES}
        _, now = get(emulator, "?recursive=true")
        timed = get(emulator, f"?recursive=true&wait_for_change=true&last_etag={now}&timeout_sec=1")
        assert timed[1] == now  # the timeout ends the wait with the same tree


def test_the_script_logs_each_request_when_asked(tmp_path: Path) -> None:
    attributes = tmp_path / "attrs.yaml"
    attributes.write_text("k: v\n")
    argv = [sys.executable, mds_emulator.__file__, "--port", "0", "--attributes", str(attributes)]
    with started([*argv, "--log-requests"], stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        host = proc.stdout.readline().split()[-1]
        url = f"http://{host}/computeMetadata/v1/instance/attributes/k"
        with urllib.request.urlopen(
            urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        ) as answer:
            assert answer.read() == b"v"
        assert proc.stderr.readline() == "GET /computeMetadata/v1/instance/attributes/k -> 200\n"
        proc.terminate()
        assert proc.wait(10) == 0


def signal_set(status: str, field: str) -> set[int]:
    """The signals of a /proc/PID/status mask line (SigBlk: blocked, SigCgt: with a handler)."""
    line = next(x for x in status.splitlines() if x.startswith(f"{field}:"))
    mask = int(line.split()[1], 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_the_script_stops_on_its_signal_with_no_handler_that_could_deadlock(
    tmp_path: Path, stop: signal.Signals
) -> None:
    """No handler of the script's for SIGTERM (SigCgt; SIGINT keeps Python's own, which a blocked
    signal never reaches), and every thread but the main one blocks both (SigBlk; the main one is
    in sigwait, which takes them while it waits): a Python handler that set an Event could
    deadlock on that Event's own lock."""
    argv = [sys.executable, mds_emulator.__file__, "--port", "0"]
    stops = {signal.SIGTERM, signal.SIGINT}
    with started(argv, stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        proc.stdout.readline()  # listening
        tasks = list(Path(f"/proc/{proc.pid}/task").iterdir())
        assert len(tasks) > 1  # the server's thread beside the main one
        for task in tasks:
            status = (task / "status").read_text()
            assert signal.SIGTERM not in signal_set(status, "SigCgt"), f"thread {task.name} has a handler"
            if task.name != str(proc.pid):
                assert stops <= signal_set(status, "SigBlk"), f"thread {task.name} takes them"
        proc.send_signal(stop)
        assert proc.wait(30) == 0
        assert json.loads(proc.stdout.read())["requests"] == 0  # it stopped as it should, and said so
