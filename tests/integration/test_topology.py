"""scripts/topology.sh: simulated hosts that answer ssh with their own names, a link that carries its shaped rate
(measured, within what tbf guarantees), and a `down` that leaves nothing behind."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT, alive, unavailable
from tests.integration.netns_hosts import missing_for_netns, state_dir

TOPOLOGY = str(ROOT / "scripts" / "topology.sh")
RATE, RATE_BPS = "200mbit", 200e6


def _topology(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TOPOLOGY, *args], capture_output=True, text=True, timeout=60)


def _up(prefix: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Build a 2-host, 2-slot topology shaped to RATE (after removing one a killed run left); return up's output
    and the topology's JSON."""
    reason = missing_for_netns(shaping=True)
    if reason:
        unavailable(reason)
    _topology("down", "--prefix", prefix)
    up = _topology("up", "--hosts", "2", "--slots", "2", "--rate", RATE, "--prefix", prefix)
    if up.returncode:
        unavailable(f"scripts/topology.sh up failed: {up.stdout}{up.stderr}")
    return up, json.loads((state_dir(prefix) / "topology.json").read_text())


@pytest.fixture(scope="module")
def shaped():
    """The topology 'tpt' (hostA, hostB on 200mbit links): yields up's output and its JSON, removed afterwards."""
    try:
        yield _up("tpt")
    finally:
        _topology("down", "--prefix", "tpt")


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True, timeout=30)
    return {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}


def test_up_describes_the_hosts_and_how_to_launch(shaped):
    up, state = shaped
    assert [(h["name"], h["ns"], h["addr"]) for h in state["hosts"]] == [
        ("hostA", "tptA", "10.78.0.1"),
        ("hostB", "tptB", "10.78.0.2"),
    ]
    assert (state["launcher"]["ns"], state["slots"], state["rate_bps"]) == ("tptL", 2, RATE_BPS)
    assert "-np 4 -H hostA:2,hostB:2" in up.stdout and "--mca mpi_yield_when_idle 1" in up.stdout, up.stdout
    assert state["key"] in up.stdout and Path(state["key"]).is_file()
    assert _topology("status", "--prefix", "tpt").returncode == 0


def test_each_host_answers_ssh_with_its_own_name(shaped):
    _, state = shaped
    checks = " && ".join(
        ["hostname"] + [f"ssh -i {state['key']} -o BatchMode=yes {h['name']} hostname" for h in state["hosts"]]
    )
    launcher = state["launcher"]
    done = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            launcher["ns"],
            "unshare",
            "--uts",
            "sh",
            "-c",
            f"hostname {launcher['name']} && {checks}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.stdout.split() == ["hvdlaunch", "hostA", "hostB"], done.stdout + done.stderr


def test_bulk_transfer_runs_at_the_shaped_rate(shaped):
    measured = _topology("measure", "--prefix", "tpt", "--seconds", "2", "--json")
    assert measured.returncode == 0, measured.stdout + measured.stderr
    result = json.loads(measured.stdout)
    print(
        f"\nhostA -> hostB at {RATE}: {result['rate_bps'] / 1e6:.1f} Mbit/s, TCP round trip {result['rtt_ms']:.3f} ms"
    )
    assert 0.5 * RATE_BPS <= result["rate_bps"] <= 1.15 * RATE_BPS, result


def test_down_removes_everything():
    _, state = _up("tpd")
    pidfiles = sorted(state_dir("tpd").glob("sshd-*.pid"))
    pids = [int(p.read_text()) for p in pidfiles]
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    namespaces = {state["launcher"]["ns"], *(h["ns"] for h in state["hosts"])}
    assert namespaces <= _namespaces()
    down = _topology("down", "--prefix", "tpd")
    assert down.returncode == 0, down.stdout + down.stderr
    assert not namespaces & _namespaces()
    assert not [ns for ns in namespaces if (Path("/etc/netns") / ns).exists()]
    assert not state_dir("tpd").exists()
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if alive(pid)], "sshd left running"
    assert _topology("status", "--prefix", "tpd").returncode == 1
