"""The launcher blames the rank that failed first, not the peers whose errors are its consequence, and names it once
in its report, with its host and exit status (real child processes under the real supervisor)."""

import sys

import pytest

from hvdplus.runner.blame import Blame
from hvdplus.runner.supervise import Supervisor

CAUSE = b"RuntimeError: rank 1 fails on purpose\n"
PEER = b"hvdplus.common.exceptions.HorovodInternalError: hvdplus was shut down on rank 1; the collective cannot\n"


def test_a_consequence_seen_first_does_not_take_the_blame():
    blame = Blame()
    blame.observe(0, b"[rank0]: " + PEER)
    blame.observe(2, PEER)
    blame.observe(1, b"Traceback (most recent call last):\n")
    blame.observe(1, b"[rank1]: " + CAUSE)
    cause = blame.root_cause()
    assert (cause.rank, cause.line) == (1, "RuntimeError: rank 1 fails on purpose")
    assert blame.consequences(cause) == [0, 2]


def test_only_consequences_blame_the_first_of_them_and_no_exception_blames_nobody():
    blame = Blame()
    assert blame.root_cause() is None
    blame.observe(2, b"HorovodInternalError: collective failed on rank 2: Connection closed by peer\n")
    blame.observe(0, PEER)
    assert blame.root_cause().rank == 2


def test_each_rank_keeps_its_first_exception():
    blame = Blame()
    blame.observe(1, CAUSE)
    blame.observe(1, b"ValueError: raised while handling the first\n")
    assert blame.root_cause().line.startswith("RuntimeError")
    blame.observe(3, b"ordinary output that mentions an Error in passing\n")
    assert blame.consequences(blame.root_cause()) == []


def test_a_rank_the_others_name_as_frozen_is_blamed():
    blame = Blame()
    frozen = b"HorovodInternalError: rank 1 did not answer a control round for 5 s (frozen or hung)\n"
    blame.observe(0, frozen)
    blame.observe(2, frozen)
    cause = blame.root_cause()
    assert (cause.rank, cause.line, cause.frozen) == (1, "frozen or hung: no answer to the control rounds", True)
    assert blame.consequences(cause) == [0, 2]


def test_a_rank_the_others_name_as_frozen_in_a_planned_step_is_blamed():
    blame = Blame()
    blame.observe(0, b"HorovodInternalError: ranks [2, 3] did not answer a planned step for 5 s (frozen or hung)\n")
    blame.observe(1, b"HorovodInternalError: ranks [2, 3] did not answer a planned step for 6 s (frozen or hung)\n")
    cause = blame.root_cause()
    assert (cause.rank, cause.line, cause.frozen) == (2, "frozen or hung: no answer to a planned step", True)
    assert blame.consequences(cause) == [0, 1]


def test_a_chained_exception_counts_as_the_exception_it_led_to():
    """Gloo ends a frozen peer's planned step with a timeout, from which the rank raises the verdict naming the
    peer: Python prints the timeout first, and only the verdict is this rank's failure."""
    blame = Blame()
    blame.observe(0, b"[rank0]: RuntimeError: Timed out waiting 5000ms for recv operation to complete\n")
    blame.observe(0, b"[rank0]: \n")
    blame.observe(0, b"[rank0]: The above exception was the direct cause of the following exception:\n")
    blame.observe(0, b"[rank0]: Traceback (most recent call last):\n")
    blame.observe(0, b"[rank0]: HorovodInternalError: rank 1 did not answer a planned step for 5 s (frozen or hung)\n")
    blame.observe(0, b"[rank0]: ValueError: a later, unrelated traceback\n")
    blame.observe(2, b"KeyError: first\n")
    blame.observe(2, b"During handling of the above exception, another exception occurred:\n")
    blame.observe(2, b"HorovodInternalError: rank 1 did not answer a planned step for 5 s (frozen or hung)\n")
    cause = blame.root_cause()
    assert (cause.rank, cause.line, cause.frozen) == (1, "frozen or hung: no answer to a planned step", True)
    assert blame.consequences(cause) == [0, 2]


def _rank(*steps: str) -> list[str]:
    """A child that runs `steps` (Python statements), then runs until its lifeline (stdin) closes, as agents do."""
    return [sys.executable, "-c", "import sys, time\n" + "\n".join(steps) + "\nsys.stdin.read()"]


def _fail(line: bytes, delay: float = 0.0) -> list[str]:
    return _rank(f"time.sleep({delay})", f"sys.stderr.write({line.decode()!r}); sys.stderr.flush()", "sys.exit(1)")


def _report(capfd, supervisor: Supervisor) -> str:
    assert supervisor.wait() != 0
    [line] = [line for line in capfd.readouterr().err.splitlines() if line.startswith("hvdplusrun:")]
    return line


def test_the_report_names_the_culprit_once_with_its_host_and_exit_status(capfd):
    """The issue's case: rank 0 (a consequence) exits first, rank 1 (the cause) a moment later, rank 2 runs on."""
    supervisor = Supervisor(hosts={0: "hostA", 1: "hostB", 2: "hostB"})
    for rank, argv in enumerate([_fail(PEER), _fail(CAUSE, delay=0.3), _rank()]):
        supervisor.start(f"rank {rank} on {supervisor.hosts[rank]}", argv, rank=rank, payload=b"{}\n")
    line = _report(capfd, supervisor)
    assert line == (
        "hvdplusrun: rank 1 on hostB failed with exit code 1 (RuntimeError: rank 1 fails on purpose); "
        "then rank 0 failed as a consequence; stopping 1 other worker. Last output:"
    ), line


def test_a_rank_that_exits_before_reading_its_payload_is_reported_not_a_launcher_crash(capfd):
    """A payload larger than the pipe's buffer makes the write wait for the child, which exits without reading it:
    the write's broken pipe must not escape start() (it once did, when a slow launcher wrote after a rank's exit)."""
    supervisor = Supervisor(hosts={0: "localhost"})
    supervisor.start("rank 0 on localhost", _fail(CAUSE), rank=0, payload=b"{}" + b" " * (1 << 20) + b"\n")
    line = _report(capfd, supervisor)
    assert line.startswith("hvdplusrun: rank 0 on localhost failed with exit code 1"), line


@pytest.mark.parametrize(
    "size,stopped", [(2, "; stopping 1 other worker."), (3, "; stopping 2 other workers."), (1, ".")]
)
def test_a_killed_rank_and_how_many_workers_are_stopped(capfd, size, stopped):
    supervisor = Supervisor(hosts={rank: "localhost" for rank in range(size)})
    for rank in range(size):
        argv = _rank("import os, signal", "os.kill(os.getpid(), signal.SIGKILL)") if rank == size - 1 else _rank()
        supervisor.start(f"rank {rank} on localhost", argv, rank=rank, payload=b"{}\n")
    line = _report(capfd, supervisor)
    assert line == f"hvdplusrun: rank {size - 1} on localhost failed with killed by SIGKILL{stopped}", line


def test_a_frozen_rank_is_stopped_and_named_once(capfd):
    frozen = b"HorovodInternalError: rank 1 did not answer a control round for 5 s (frozen or hung)\n"
    supervisor = Supervisor(hosts={0: "hostA", 1: "hostA", 2: "hostB"})
    for rank, argv in enumerate([_fail(frozen), _rank(), _rank()]):
        supervisor.start(f"rank {rank}", argv, rank=rank, payload=b"{}\n")
    line = _report(capfd, supervisor)
    assert line == (
        "hvdplusrun: rank 1 on hostA failed (frozen or hung: no answer to the control rounds) and has "
        "not exited; then rank 0 failed as a consequence; stopping it and 1 other worker."
    ), line


def test_under_mpirun_the_rank_is_named_from_its_tagged_output_with_mpiruns_status(capfd):
    supervisor = Supervisor(hosts={0: "hostA", 1: "hostB"})
    tagged = b"[1,1]<stderr>:" + CAUSE
    supervisor.start("mpirun", _rank(f"sys.stderr.write({tagged.decode()!r}); sys.stderr.flush()", "sys.exit(3)"))
    line = _report(capfd, supervisor)
    assert line == (
        "hvdplusrun: rank 1 on hostB failed (RuntimeError: rank 1 fails on purpose); "
        "mpirun exited with exit code 3. Last output:"
    ), line
