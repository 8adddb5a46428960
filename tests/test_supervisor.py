"""The supervisor with real (tiny) processes: startup failures quote the log, crashes are
restarted with doubling backoff until the limit, and stopping kills whole process groups,
even a process that ignores SIGTERM and the child it started."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.cluster.process import ManagedProcess
from pdserve.cluster.schema import RestartSection
from pdserve.cluster.supervisor import LaunchError, Service, Supervisor
from tests.servers import ROOT, alive


def service(tmp_path: Path, name: str, code: str, healthy=lambda: True) -> Service:
    proc = ManagedProcess([sys.executable, "-c", code], tmp_path / f"{name}.log")
    return Service(name, "node", proc, healthy, f"http://{name}", str(proc.log_path))


def supervisor(stages, **restart) -> tuple[Supervisor, list[str]]:
    said: list[str] = []
    sup = Supervisor(
        stages,
        RestartSection(**restart),
        startup_timeout_s=60,
        drain_timeout_s=2,
        say=said.append,
        kill_margin_s=0,
    )
    return sup, said


def test_startup_failure_names_the_process_and_quotes_its_log(tmp_path):
    code = "import sys; print('model file is corrupt'); sys.exit(3)"
    bad = service(tmp_path, "decode-0", code, healthy=lambda: False)
    sup, _ = supervisor([[bad]])
    with pytest.raises(LaunchError, match="decode-0 exited with code 3") as e:
        sup.start_all()
    assert "model file is corrupt" in str(e.value)
    sup.stop_all()


def test_not_healthy_in_time_fails_the_launch(tmp_path):
    slow = service(tmp_path, "prefill-0", "import time; time.sleep(60)", healthy=lambda: False)
    sup, _ = supervisor([[slow]])
    sup.startup_timeout_s = 1.0
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="prefill-0 was not healthy in time"):
        sup.start_all()
    assert time.monotonic() - t0 >= 1.0
    sup.stop_all()
    assert not alive(slow.handle.pid)


def test_crash_is_restarted_with_backoff_until_the_limit(tmp_path):
    # Healthy at once, then exits after 0.3 s: a crash loop.
    crashing = service(tmp_path, "decode-0", "import time; time.sleep(0.3)")
    sup, said = supervisor([[crashing]], backoff_s=0.2, backoff_max_s=0.4, max_restarts=3)
    sup.start_all()
    pids, starts = {crashing.handle.pid}, []
    deadline = time.monotonic() + 60
    while crashing.state != "failed":
        assert time.monotonic() < deadline, said
        state = crashing.state
        sup.tick()
        if state == "backoff" and crashing.state == "starting":
            starts.append(time.monotonic())
            pids.add(crashing.handle.pid)
        time.sleep(0.02)
    assert crashing.total_restarts == 3 and len(pids) == 4
    assert sum("restarting in 0.2 s" in s for s in said) == 1
    assert sum("restarting in 0.4 s" in s for s in said) == 2  # doubled, then capped
    assert "not restarting" in said[-1]


def test_stop_kills_the_group_even_when_sigterm_is_ignored(tmp_path):
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    stubborn = service(tmp_path, "router", code)
    sup, _ = supervisor([[stubborn]])
    sup.start_all()
    deadline = time.monotonic() + 30
    while not (last := stubborn.handle.tail(1)).isdigit():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(last)
    t0 = time.monotonic()
    sup.stop_all()
    assert 2.0 <= time.monotonic() - t0 < 30  # the drain timeout, then SIGKILL
    assert not alive(stubborn.handle.pid) and not alive(child)
    assert stubborn.state == "stopped"


def test_children_die_with_a_killed_launcher(tmp_path):
    """PR_SET_PDEATHSIG: even a SIGKILLed launcher leaves no orphan behind."""
    launcher_code = (
        "import sys, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from pdserve.cluster.process import ManagedProcess\n"
        "child = ManagedProcess([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
        f"                     {str(tmp_path / 'child.log')!r})\n"
        "child.start()\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", launcher_code], stdout=subprocess.PIPE, text=True
    )
    child = int(launcher.stdout.readline())
    assert alive(child)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 30
    while alive(child):
        assert time.monotonic() < deadline, "the child outlived its killed launcher"
        time.sleep(0.05)
