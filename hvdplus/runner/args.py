"""hvdplusrun's command line: horovodrun's flags, same names and meaning, plus --config-file values."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence

from hvdplus.common.settings import CROSS_ALGORITHMS
from hvdplus.runner.config import load_config

__all__ = ["make_parser", "parse_args"]

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def _whole_number(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return int(text)


def _add_launch_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-np",
        "--num-proc",
        dest="np",
        type=_positive_int,
        help="number of ranks (default: every slot of -H/--hostfile/the Slurm allocation)",
    )
    parser.add_argument("-H", "--hosts", help="hosts and slots: host1:4,host2:4")
    parser.add_argument("-hostfile", "--hostfile", help="file with one 'hostname slots=N' per line")
    parser.add_argument("-p", "--ssh-port", type=_positive_int, help="ssh port of the remote hosts")
    parser.add_argument("-i", "--ssh-identity-file", help="ssh private key for the remote hosts")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--gloo", action="store_true", help="hvdplus's own launcher; torch.distributed Gloo")
    mode.add_argument("--mpi", action="store_true", help="launch with mpirun; CPU collectives over MPI")
    parser.add_argument("--mpi-args", default="", help="extra arguments for mpirun, as one string")
    parser.add_argument(
        "--network-interfaces",
        "--network-interface",
        dest="nics",
        help="comma-separated interfaces for the job's traffic, e.g. eth0",
    )
    parser.add_argument(
        "--start-timeout",
        type=_positive_int,
        help="seconds for ssh to connect and for every worker to reach the rendezvous",
    )
    parser.add_argument("--output-filename", help="also write each rank's output to DIR/rank.N/stdout|stderr")
    parser.add_argument("--verbose", action="store_true", help="print the commands and hosts used")
    parser.add_argument(
        "--disable-cache",
        action="store_true",
        help="accepted for horovodrun compatibility (hvdplusrun keeps no host cache)",
    )
    parser.add_argument("--config-file", help="YAML (or JSON) file with the tuning parameters below")
    parser.add_argument(
        "-x",
        dest="env",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="set NAME=VALUE (or pass this NAME) in every worker's environment; repeatable",
    )
    parser.add_argument(
        "--no-horovod-alias",
        dest="horovod_alias",
        action="store_false",
        help="do not let `import horovod.torch` resolve to hvdplus in the workers",
    )
    parser.add_argument(
        "-cb",
        "--check-build",
        action="store_true",
        help="show the frameworks, engines and MPI hvdplus finds, then exit",
    )


def _add_tuning_flags(parser: argparse.ArgumentParser) -> None:
    tuning = parser.add_argument_group("tuning (passed to the workers as HVDPLUS_* settings)")
    tuning.add_argument("--fusion-threshold-mb", type=int, help="fusion buffer size in MB (0 disables)")
    tuning.add_argument("--cycle-time-ms", type=float, help="milliseconds between negotiation cycles")
    tuning.add_argument("--cache-capacity", type=int, help="response cache entries (0 disables)")
    tuning.add_argument(
        "--hierarchical-allreduce",
        action=argparse.BooleanOptionalAction,
        help="allreduce within hosts, then across hosts (hosts with equal slots)",
    )
    tuning.add_argument(
        "--hierarchical-allgather",
        action=argparse.BooleanOptionalAction,
        help="allgather within hosts, across hosts between local rank 0s, then broadcast in hosts",
    )
    tuning.add_argument(
        "--cross-algorithm",
        choices=CROSS_ALGORITHMS,
        help="algorithm of the cross-host step of hierarchical allreduce (default: auto)",
    )
    tuning.add_argument("--timeline-filename", help="rank 0 writes a Chrome-trace timeline there")
    tuning.add_argument(
        "--timeline-mark-cycles", action=argparse.BooleanOptionalAction, help="mark negotiation cycles in the timeline"
    )
    tuning.add_argument(
        "--stall-check",
        action=argparse.BooleanOptionalAction,
        help="warn about collectives only some ranks submitted (--no-stall-check disables)",
    )
    tuning.add_argument(
        "--stall-check-warning-time-seconds", type=float, help="seconds before a stalled collective is reported"
    )
    tuning.add_argument(
        "--stall-check-shutdown-time-seconds",
        type=float,
        help="seconds after which a stalled collective fails every rank (0: never)",
    )
    tuning.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, help="hvdplus log level in the workers")


def _add_autotune_flags(parser: argparse.ArgumentParser) -> None:
    autotune = parser.add_argument_group("autotune (passed to the workers as HVDPLUS_AUTOTUNE* settings)")
    autotune.add_argument(
        "--autotune",
        action="store_true",
        default=None,
        help="pick fusion threshold, cycle time and hierarchical options from measured throughput "
        "during the first steps; tuning flags given explicitly stay fixed",
    )
    autotune.add_argument("--autotune-log-file", help="rank 0 writes every autotune sample there as CSV")
    autotune.add_argument(
        "--autotune-warmup-samples", type=_whole_number, help="samples discarded at the start (default 3)"
    )
    autotune.add_argument(
        "--autotune-steps-per-sample", type=_positive_int, help="cycles with collectives per sample (default 10)"
    )
    autotune.add_argument(
        "--autotune-bayes-opt-max-samples",
        type=_positive_int,
        help="most configurations measured before keeping the best (default 20)",
    )
    autotune.add_argument(
        "--autotune-gaussian-process-noise",
        type=float,
        help="accepted for horovodrun compatibility; unused (hvdplus searches a grid, without a Gaussian process)",
    )


def _add_elastic_flags(parser: argparse.ArgumentParser) -> None:
    elastic = parser.add_argument_group(
        "elastic (Gloo mode; any of --min-np and --host-discovery-script makes the job elastic)"
    )
    elastic.add_argument(
        "--min-np",
        "--min-num-proc",
        dest="min_np",
        type=_positive_int,
        help="fewest workers to train with; below it the job waits (up to --elastic-timeout) for hosts (default: -np)",
    )
    elastic.add_argument(
        "--max-np",
        "--max-num-proc",
        dest="max_np",
        type=_positive_int,
        help="most workers to start (default: every slot discovery offers)",
    )
    elastic.add_argument(
        "--host-discovery-script",
        help="executable printing the available hosts, one 'host' or 'host:slots' per line; run about every second",
    )
    elastic.add_argument(
        "--slots-per-host",
        "--slots",
        dest="slots_per_host",
        type=_positive_int,
        help="slots of a discovered host that prints no ':slots' (default: 1)",
    )
    elastic.add_argument(
        "--elastic-timeout",
        type=_positive_int,
        help="seconds to wait for --min-np slots, and a worker for the next generation "
        "(default: HOROVOD_ELASTIC_TIMEOUT, else 600)",
    )
    elastic.add_argument(
        "--reset-limit", type=_whole_number, help="end the job once it has been reset (grown or shrunk) this many times"
    )
    elastic.add_argument(
        "--blacklist-cooldown-range",
        dest="cooldown_range",
        type=_whole_number,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="a failed host comes back after a random cooldown in MIN..MAX seconds, doubling "
        "with each failure (default: never)",
    )
    elastic.add_argument(
        "--wait-for-new-workers",
        action="store_true",
        help="at a scale-up, the workers wait at their next commit until the new workers have started (reached "
        "hvd.init), up to --elastic-timeout, as in Horovod, so the script sees the new size there (default: they "
        "train on, and the new workers join once started)",
    )


def make_parser() -> argparse.ArgumentParser:
    """The argument parser, with horovodrun's flag names."""
    parser = argparse.ArgumentParser(
        prog="hvdplusrun",
        description="Launch an hvdplus (or unmodified Horovod) job on this machine, "
        "on hosts reached over ssh, or inside a Slurm allocation.",
        epilog="example: hvdplusrun -np 8 -H node1:4,node2:4 python train.py",
    )
    _add_launch_flags(parser)
    _add_tuning_flags(parser)
    _add_autotune_flags(parser)
    _add_elastic_flags(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program to run on every rank")
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse and check the command line; --config-file values fill flags not given on the command line."""
    parser = make_parser()
    args = parser.parse_args(list(argv))
    if args.config_file:
        try:
            for dest, value in load_config(args.config_file).items():
                if getattr(args, dest) is None:
                    setattr(args, dest, str(value).upper() if dest == "log_level" else value)
        except ValueError as exc:
            parser.error(str(exc))
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command and not args.check_build:
        parser.error("give the program to run, e.g. hvdplusrun -np 2 python train.py")
    if args.hosts and args.hostfile:
        parser.error("give -H/--hosts or --hostfile, not both")
    if args.host_discovery_script and (args.hosts or args.hostfile):
        parser.error("give --host-discovery-script or -H/--hostfile, not both")
    if args.cooldown_range and not 0 < args.cooldown_range[0] <= args.cooldown_range[1]:
        parser.error(
            f"--blacklist-cooldown-range {args.cooldown_range[0]} {args.cooldown_range[1]}: expected 0 < MIN <= MAX"
        )
    try:
        args.mpi_args = shlex.split(args.mpi_args)
    except ValueError as exc:
        parser.error(f"--mpi-args {args.mpi_args!r}: {exc}")
    bad = [e for e in args.env if not e.split("=", 1)[0].isidentifier()]
    if bad:
        parser.error(f"-x {bad[0]!r}: expected NAME or NAME=VALUE")
    return args
