"""hvdplusrun's flags: horovodrun names, config files, and the worker environment they produce."""

import importlib.util
import sys

import pytest

from hvdplus.common.settings import Settings
from hvdplus.runner.args import parse_args
from hvdplus.runner.config import load_config
from hvdplus.runner.job import ALIAS_PATH, job_from_args, tuning_env


def test_horovodrun_flags_parse():
    args = parse_args(
        [
            "-np",
            "8",
            "-H",
            "n1:4,n2:4",
            "-p",
            "2222",
            "--gloo",
            "--network-interfaces",
            "eth0,ib0",
            "--start-timeout",
            "15",
            "--verbose",
            "--disable-cache",
            "python",
            "train.py",
            "--lr",
            "1",
        ]
    )
    assert (args.np, args.hosts, args.ssh_port, args.gloo, args.nics) == (8, "n1:4,n2:4", 2222, True, "eth0,ib0")
    assert args.command == ["python", "train.py", "--lr", "1"]


def test_tuning_flags_map_onto_settings_names():
    args = parse_args(
        [
            "-np",
            "1",
            "--fusion-threshold-mb",
            "32",
            "--cycle-time-ms",
            "5",
            "--cache-capacity",
            "0",
            "--hierarchical-allreduce",
            "--hierarchical-allgather",
            "--cross-algorithm",
            "ring",
            "--timeline-filename",
            "t.json",
            "--timeline-mark-cycles",
            "--no-stall-check",
            "--stall-check-warning-time-seconds",
            "30",
            "--stall-check-shutdown-time-seconds",
            "90",
            "--log-level",
            "debug",
            "--start-timeout",
            "20",
            "python",
            "x.py",
        ]
    )
    assert tuning_env(args) == {
        "HVDPLUS_FUSION_THRESHOLD": str(32 * 1024 * 1024),
        "HVDPLUS_CYCLE_TIME": "5.0",
        "HVDPLUS_CACHE_CAPACITY": "0",
        "HVDPLUS_HIERARCHICAL_ALLREDUCE": "1",
        "HVDPLUS_HIERARCHICAL_ALLGATHER": "1",
        "HVDPLUS_CROSS_ALGORITHM": "ring",
        "HVDPLUS_TIMELINE": "t.json",
        "HVDPLUS_TIMELINE_MARK_CYCLES": "1",
        "HVDPLUS_STALL_CHECK_DISABLE": "1",
        "HVDPLUS_STALL_CHECK_TIME_SECONDS": "30.0",
        "HVDPLUS_STALL_SHUTDOWN_TIME_SECONDS": "90.0",
        "HVDPLUS_LOG_LEVEL": "debug",
        "HVDPLUS_TIMEOUT": "20",
    }


def test_autotune_flags_map_onto_settings_names():
    args = parse_args(
        [
            "-np",
            "1",
            "--autotune",
            "--autotune-log-file",
            "at.csv",
            "--autotune-warmup-samples",
            "0",
            "--autotune-steps-per-sample",
            "5",
            "--autotune-bayes-opt-max-samples",
            "12",
            "--autotune-gaussian-process-noise",
            "0.5",
            "python",
            "x.py",
        ]
    )
    assert tuning_env(args) == {
        "HVDPLUS_AUTOTUNE": "1",
        "HVDPLUS_AUTOTUNE_LOG": "at.csv",
        "HVDPLUS_AUTOTUNE_WARMUP_SAMPLES": "0",
        "HVDPLUS_AUTOTUNE_STEPS_PER_SAMPLE": "5",
        "HVDPLUS_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "12",
    }
    assert args.autotune_gaussian_process_noise == 0.5  # accepted for horovodrun, unused by the grid search


def test_autotune_settings_fixed_by_flags_reach_the_workers_as_explicit():
    env = tuning_env(parse_args(["-np", "1", "--autotune", "--cycle-time-ms", "2", "python", "x.py"]))
    settings = Settings.from_env(env)
    assert settings.autotune and settings.cycle_time_ms == 2.0
    assert settings.explicit == {"autotune", "cycle_time_ms"}


def test_unset_tuning_flags_set_nothing():
    assert tuning_env(parse_args(["-np", "1", "python", "x.py"])) == {}


def test_config_file_fills_unset_flags(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "params:\n  fusion_threshold_mb: 8\n  cycle_time_ms: 3  # ms\n"
        "timeline:\n  filename: '/tmp/t.json'\n  mark_cycles: yes\nlogging:\n  level: info\n"
    )
    args = parse_args(["-np", "1", "--config-file", str(config), "--cycle-time-ms", "9", "python", "x.py"])
    assert (args.fusion_threshold_mb, args.cycle_time_ms, args.timeline_filename) == (8, 9.0, "/tmp/t.json")
    assert (args.timeline_mark_cycles, args.log_level) == (True, "INFO")


def test_config_file_autotune_section(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "autotune:\n  enabled: true\n  log_file: /tmp/at.csv\n  warmup_samples: 1\n"
        "  steps_per_sample: 4\n  bayes_opt_max_samples: 8\n  gaussian_process_noise: 0.8\n"
    )
    args = parse_args(["-np", "1", "--config-file", str(config), "--autotune-steps-per-sample", "6", "python", "x.py"])
    assert tuning_env(args) == {
        "HVDPLUS_AUTOTUNE": "1",
        "HVDPLUS_AUTOTUNE_LOG": "/tmp/at.csv",
        "HVDPLUS_AUTOTUNE_WARMUP_SAMPLES": "1",
        "HVDPLUS_AUTOTUNE_STEPS_PER_SAMPLE": "6",
        "HVDPLUS_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "8",
    }
    config.write_text("autotune:\n  enabled: false\n")
    assert tuning_env(parse_args(["-np", "1", "--config-file", str(config), "python", "x.py"])) == {
        "HVDPLUS_AUTOTUNE": "0"
    }


def test_config_file_in_json(tmp_path):
    config = tmp_path / "c.json"
    config.write_text('{"stall_check": {"enabled": false, "shutdown_time_seconds": 5}}')
    assert load_config(str(config)) == {"stall_check": False, "stall_check_shutdown_time_seconds": 5}


@pytest.mark.parametrize(
    "text,problem,yaml_problem",
    [
        ("params:\n  autotune: true\n", "params.autotune is not supported", "params.autotune is not supported"),
        ("params\n", "line 1: expected 'key: value'", "must be a mapping of sections, got str"),
        ("  cycle_time_ms: 3\n", "not under a section", "section 'cycle_time_ms' must hold 'key: value' entries"),
    ],
)
def test_config_file_errors_name_the_problem(tmp_path, monkeypatch, text, problem, yaml_problem):
    """With PyYAML (the dev extra brings it) and with the built-in subset parser, each error names the problem."""
    config = tmp_path / "c.yaml"
    config.write_text(text)
    if importlib.util.find_spec("yaml") is not None:
        with pytest.raises(ValueError, match=yaml_problem):
            load_config(str(config))
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml now fails: the subset parser reads the file
    with pytest.raises(ValueError, match=problem):
        load_config(str(config))


@pytest.mark.parametrize(
    "argv,problem",
    [
        (["-np", "2"], "give the program to run"),
        (["-np", "0", "x"], "expected a whole number >= 1"),
        (["-np", "2", "--gloo", "--mpi", "x"], "not allowed with"),
        (["-H", "a:1", "--hostfile", "h", "x"], "not both"),
        (["-x", "1BAD", "x"], "expected NAME or NAME=VALUE"),
        (["--autotune-steps-per-sample", "0", "x"], "expected a whole number >= 1"),
        (["--autotune-warmup-samples", "-1", "x"], "expected a whole number >= 0"),
    ],
)
def test_bad_command_lines_exit_with_the_reason(argv, problem, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert problem in capsys.readouterr().err


def test_worker_env_from_flags_and_launcher_env():
    environ = {"PATH": "/bin", "HOROVOD_RANK": "5", "HVDPLUS_SECRET_KEY": "old", "KEEP": "1", "PYTHONPATH": "/mine"}
    spec = job_from_args(
        parse_args(["-np", "2", "--gloo", "-x", "KEEP", "-x", "NEW=v", "--cycle-time-ms", "2", "python", "x.py"]),
        environ,
    )
    assert spec.mode == "gloo" and [s.hostname for s in spec.slots] == ["localhost", "localhost"]
    assert "HOROVOD_RANK" not in spec.env and "HVDPLUS_SECRET_KEY" not in spec.env  # never inherited
    assert (spec.env["KEEP"], spec.env["NEW"], spec.env["HVDPLUS_CYCLE_TIME"]) == ("1", "v", "2.0")
    assert spec.env["PYTHONPATH"] == f"{ALIAS_PATH}:/mine" and spec.env["HVDPLUS_CPU_OPERATIONS"] == "gloo"


def test_no_horovod_alias_and_missing_x_variable():
    spec = job_from_args(parse_args(["-np", "1", "--gloo", "--no-horovod-alias", "python", "x.py"]), {})
    assert "PYTHONPATH" not in spec.env
    with pytest.raises(ValueError, match="-x MISSING: MISSING is not set"):
        job_from_args(parse_args(["-np", "1", "--gloo", "-x", "MISSING", "python", "x.py"]), {})


def test_slurm_allocation_gives_hosts_and_default_np():
    environ = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    spec = job_from_args(parse_args(["--gloo", "python", "x.py"]), environ)
    assert [(s.rank, s.hostname, s.local_rank) for s in spec.slots] == [
        (0, "n1", 0),
        (1, "n1", 1),
        (2, "n2", 0),
        (3, "n2", 1),
    ]
    with pytest.raises(ValueError, match="give -np N"):
        job_from_args(parse_args(["--gloo", "python", "x.py"]), {})
