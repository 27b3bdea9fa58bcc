"""The elastic launcher's host bookkeeping: discovery output, host order, blacklist and cooldown (Horovod's rules),
the plan's encoding, and the elastic flags."""

from __future__ import annotations

import random

import pytest

from hvdplus.common.elastic.plan import Plan, arrived_key, failure_notice_key, holds_key, worker_id
from hvdplus.runner.args import parse_args
from hvdplus.runner.elastic_hosts import HostManager, parse_discovery_output
from hvdplus.runner.job import elastic_options


def test_discovery_lines_give_hosts_and_slots():
    assert parse_discovery_output("a:2\n\nb\n c:3 \n", slots_per_host=4) == {"a": 2, "b": 4, "c": 3}
    for bad in ("a:x", "a:0", ":2"):
        with pytest.raises(ValueError, match="expected 'host' or 'host:slots'"):
            parse_discovery_output(bad, 1)


def test_hosts_keep_the_order_they_appeared_in_and_a_returning_host_goes_last():
    hosts = HostManager()
    assert hosts.update({"a": 1, "b": 2}) and hosts.usable() == [("a", 1), ("b", 2)]
    assert hosts.update({"c": 1, "b": 2, "a": 1}) and hosts.usable() == [("a", 1), ("b", 2), ("c", 1)]
    assert not hosts.update({"c": 1, "b": 2, "a": 1})  # nothing changed
    assert hosts.update({"b": 2, "c": 1}) and hosts.usable() == [("b", 2), ("c", 1)]
    assert hosts.update({"a": 1, "b": 2, "c": 1}) and hosts.usable() == [("b", 2), ("c", 1), ("a", 1)]
    assert hosts.update({"a": 1, "b": 3, "c": 1}) and hosts.usable()[0] == ("b", 3)  # slots changed


def test_a_blacklisted_host_stays_out_without_a_cooldown():
    hosts = HostManager()
    hosts.update({"a": 1, "b": 1})
    version = hosts.version
    hosts.blacklist("a")
    assert hosts.version > version and hosts.is_blacklisted("a") and hosts.usable() == [("b", 1)]
    assert not hosts.update({"a": 1, "b": 1}) and hosts.usable() == [("b", 1)]


def test_the_cooldown_doubles_with_each_failure_within_the_range(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("hvdplus.runner.elastic_hosts.time.monotonic", lambda: clock[0])
    hosts = HostManager(cooldown_range=(1.0, 10.0), rng=random.Random(0))
    hosts.update({"a": 1, "b": 1})
    cooldowns = []
    for _ in range(4):
        hosts.blacklist("a")
        start = clock[0]
        while hosts.is_blacklisted("a"):
            clock[0] += 0.25
            hosts.update({"a": 1, "b": 1})
        cooldowns.append(clock[0] - start)
        assert hosts.usable() == [("b", 1), ("a", 1)]  # back, as a new host: last
    # Horovod's delay: MIN * 2**failures + up to MIN, within MIN..MAX (here 2-3, 4-5, 8-9, then 10)
    for failures, cooldown in enumerate(cooldowns, start=1):
        low = min(10.0, 2**failures)
        assert low <= cooldown <= min(10.0, low + 1.0) + 0.25, cooldowns


def test_a_second_failure_within_the_cooldown_neither_counts_nor_extends_it(monkeypatch):
    """Horovod's HostState.blacklist: a host already in its cooldown keeps it (its two workers failing together
    are one failure); once back, it is `returned` and the next failure doubles the cooldown."""
    clock = [100.0]
    monkeypatch.setattr("hvdplus.runner.elastic_hosts.time.monotonic", lambda: clock[0])
    hosts = HostManager(cooldown_range=(1.0, 10.0), rng=random.Random(0))
    hosts.update({"a": 2, "b": 1})
    assert not hosts.returned("a")
    hosts.blacklist("a")
    clock[0] += 1.5
    hosts.blacklist("a")  # the host's other worker, stopped with it, or failing a moment later
    clock[0] += 1.6  # 3.1 s after the first failure: past a first cooldown (2-3 s), which the second did not extend
    hosts.update({"a": 2, "b": 1})
    assert not hosts.is_blacklisted("a") and hosts.returned("a") and not hosts.returned("b")
    hosts.blacklist("a")
    clock[0] += 3.1
    hosts.update({"a": 2, "b": 1})
    assert hosts.is_blacklisted("a")  # the second failure's cooldown is 4-5 s


def test_a_host_is_back_when_its_cooldown_ends_not_at_the_next_discovery_round(monkeypatch):
    """The driver plans for a host back from its cooldown at once (the others wait for its workers from their next
    commit), so the host is usable, `returned` and the version bumped the moment its cooldown ends, without
    another discovery result; a host that the last discovery no longer listed stays out."""
    clock = [100.0]
    monkeypatch.setattr("hvdplus.runner.elastic_hosts.time.monotonic", lambda: clock[0])
    hosts = HostManager(cooldown_range=(1.0, 1.0))
    hosts.update({"a": 2, "b": 1})
    hosts.blacklist("a")
    hosts.blacklist("b")
    hosts.update({"a": 2})  # b is gone from discovery while in its cooldown
    version = hosts.version
    clock[0] += 0.9
    assert hosts.version == version and hosts.usable() == [] and not hosts.returned("a")
    clock[0] += 0.2  # past the 1 s cooldown; no update() since
    assert hosts.version == version + 1 and hosts.usable() == [("a", 2)]
    assert hosts.returned("a") and not hosts.is_blacklisted("b")


def test_a_plan_round_trips_and_names_its_keys():
    plan = Plan(3, (worker_id("a", 0), worker_id("b", 1)))
    assert Plan.decode(plan.encode()) == plan and plan.size == 2
    assert plan.rank_of("b/1") == 1 and plan.rank_of("c/0") is None
    assert arrived_key(3, 1) == "elastic/g3/arrived/1"
    assert failure_notice_key(3, 1) == "elastic/g3/hvdplus/failure/1"  # where the Gloo engine of generation 3 looks
    assert holds_key("b/1") == "elastic/holds/b/1"  # outside any generation: the launcher reads it across them


def _options(*argv: str, environ: dict[str, str] | None = None):
    return elastic_options(parse_args([*argv, "python", "train.py"]), environ or {})


def test_elastic_flags_make_the_options_as_horovodrun_does():
    assert _options("-np", "2") is None
    fixed = _options(
        "-np",
        "4",
        "--min-np",
        "2",
        "--max-np",
        "8",
        "-H",
        "a:2,b:2",
        "--reset-limit",
        "3",
        "--blacklist-cooldown-range",
        "5",
        "60",
    )
    assert (fixed.np, fixed.min_np, fixed.max_np, fixed.reset_limit, fixed.cooldown_range) == (4, 2, 8, 3, (5, 60))
    assert fixed.discover() == {"a": 2, "b": 2} and fixed.timeout == 600.0
    assert _options("-np", "2", "--min-np", "1", environ={"HOROVOD_ELASTIC_TIMEOUT": "30"}).timeout == 30.0
    assert _options("-np", "2", "--min-np", "1", "--elastic-timeout", "7").timeout == 7.0
    assert _options("--min-np", "3").np == 3  # -np defaults to --min-np
    assert not fixed.wait_for_new_workers and _options("--min-np", "1", "--wait-for-new-workers").wait_for_new_workers
    with pytest.raises(ValueError, match="--wait-for-new-workers is an elastic flag: add --min-np"):
        _options("-np", "2", "--wait-for-new-workers")


def test_the_discovery_script_must_be_executable(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho a:2\n")
    with pytest.raises(ValueError, match="not an executable file"):
        _options("-np", "2", "--host-discovery-script", str(script))
    script.chmod(0o755)
    assert _options("-np", "2", "--slots-per-host", "3", "--host-discovery-script", str(script)).discover() == {"a": 2}


def test_the_elastic_package_serves_horovods_names_and_the_launcher_imports_only_the_plan():
    """hvdplusrun imports hvdplus.common.elastic.plan with the standard library alone; the package still serves
    State, ObjectState and run_fn, as horovod.common.elastic does, loading state.py on first use."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from hvdplus.common.elastic import plan\n"
        "assert 'numpy' not in sys.modules and 'hvdplus.common.elastic.state' not in sys.modules\n"
        "from hvdplus.common.elastic import ObjectState, State, run_fn\n"
        "from hvdplus.common.elastic import state\n"
        "assert (State, ObjectState, run_fn) == (state.State, state.ObjectState, state.run_fn)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
