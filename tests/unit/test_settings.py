"""Settings.from_env and LaunchEnv.from_env, always with an explicit environ dict."""

import dataclasses

import pytest

from hvdplus.common.settings import SETTINGS, LaunchEnv, Settings


def test_defaults_with_empty_environ():
    s = Settings.from_env({})
    assert s == Settings()
    assert s.fusion_threshold == 128 * 1024 * 1024
    assert s.launch == LaunchEnv()


def test_horovod_alias_is_read():
    s = Settings.from_env(
        {"HOROVOD_FUSION_THRESHOLD": "1024", "HOROVOD_CYCLE_TIME": "5", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}
    )
    assert (s.fusion_threshold, s.cycle_time_ms, s.hierarchical_allreduce) == (1024, 5.0, True)


def test_hvdplus_name_wins_over_horovod_alias():
    s = Settings.from_env({"HVDPLUS_FUSION_THRESHOLD": "7", "HOROVOD_FUSION_THRESHOLD": "9"})
    assert s.fusion_threshold == 7


def test_hvdplus_name_wins_even_when_alias_is_invalid():
    s = Settings.from_env({"HVDPLUS_CACHE_CAPACITY": "3", "HOROVOD_CACHE_CAPACITY": "junk"})
    assert s.cache_capacity == 3


def test_every_setting_has_a_distinct_env_name_and_matching_field():
    names = [s.env for s in SETTINGS] + [s.alias for s in SETTINGS if s.alias]
    assert len(names) == len(set(names))
    fields = set(Settings.__dataclass_fields__)
    assert all(s.field in fields for s in SETTINGS)
    assert all(getattr(Settings(), s.field) == s.default for s in SETTINGS)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("off", False),
        ("", False),
    ],
)
def test_boolean_parsing(text, expected):
    assert Settings.from_env({"HVDPLUS_STALL_CHECK_DISABLE": text}).stall_check_disable is expected


@pytest.mark.parametrize(
    "var,value",
    [("HVDPLUS_FUSION_THRESHOLD", "lots"), ("HOROVOD_CYCLE_TIME", "fast"), ("HOROVOD_HIERARCHICAL_ALLREDUCE", "maybe")],
)
def test_bad_value_raises_value_error_naming_the_variable(var, value):
    with pytest.raises(ValueError, match=var) as info:
        Settings.from_env({var: value})
    assert repr(value) in str(info.value)


def test_unknown_override_raises_type_error():
    with pytest.raises(TypeError, match="no_such_knob"):
        Settings.from_env({}, no_such_knob=1)


def test_override_wins_over_environment():
    s = Settings.from_env({"HVDPLUS_FUSION_THRESHOLD": "7"}, fusion_threshold=11)
    assert s.fusion_threshold == 11


@pytest.mark.parametrize(
    "kwargs", [{"fusion_threshold": -1}, {"cycle_time_ms": 0}, {"cpu_operations": "tcp"}, {"gpu_operations": "rccl"}]
)
def test_out_of_range_values_are_rejected(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Settings(**kwargs)


def test_out_of_range_env_value_names_the_variable():
    with pytest.raises(ValueError, match="HOROVOD_CPU_OPERATIONS"):
        Settings.from_env({"HOROVOD_CPU_OPERATIONS": "tcp"})


def test_bad_launch_rank_names_the_variable():
    with pytest.raises(ValueError, match="HOROVOD_RANK"):
        Settings.from_env({"HOROVOD_RANK": "first"})


def test_settings_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().fusion_threshold = 1  # type: ignore[misc]


def test_launch_env_reads_horovod_rank_and_size():
    env = LaunchEnv.from_env(
        {"HOROVOD_RANK": "2", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "0", "HOROVOD_HOSTNAME": "node1"}
    )
    assert (env.rank, env.size, env.local_rank, env.hostname) == (2, 4, 0, "node1")


def test_launch_env_rank_zero_is_not_treated_as_unset():
    env = LaunchEnv.from_env({"HOROVOD_RANK": "0", "SLURM_PROCID": "5"})
    assert env.rank == 0


def test_launch_env_hvdplus_wins_over_horovod():
    env = LaunchEnv.from_env({"HVDPLUS_RANK": "1", "HOROVOD_RANK": "3"})
    assert env.rank == 1


def test_launch_env_falls_back_to_slurm():
    env = LaunchEnv.from_env(
        {
            "SLURM_PROCID": "3",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_JOB_NODELIST": "n[1-2]",
            "SLURM_TASKS_PER_NODE": "4(x2)",
        }
    )
    assert (env.rank, env.size, env.local_rank) == (3, 8, 1)
    assert (env.slurm_nodelist, env.slurm_tasks_per_node) == ("n[1-2]", "4(x2)")


def test_launch_env_empty_value_falls_through_to_next_name():
    env = LaunchEnv.from_env({"HOROVOD_RANK": "", "SLURM_PROCID": "6"})
    assert env.rank == 6


def test_launch_env_rendezvous():
    env = LaunchEnv.from_env(
        {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "1234", "MASTER_ADDR": "ignored"}
    )
    assert (env.rendezvous_addr, env.rendezvous_port) == ("10.0.0.1", 1234)
    assert LaunchEnv.from_env({"MASTER_ADDR": "h"}).rendezvous_addr == "h"


def test_under_mpi_detected_from_ompi():
    assert LaunchEnv.from_env({"OMPI_COMM_WORLD_SIZE": "4"}).under_mpi is True
    assert LaunchEnv.from_env({"PMI_SIZE": "2"}).under_mpi is True


def test_not_under_mpi_without_mpi_variables():
    assert LaunchEnv.from_env({"HOROVOD_RANK": "0", "OMPI_COMM_WORLD_SIZE": ""}).under_mpi is False


def test_settings_from_env_builds_launch():
    s = Settings.from_env({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"})
    assert (s.launch.rank, s.launch.size) == (1, 2)


def test_autotune_settings_and_horovod_names():
    s = Settings.from_env(
        {
            "HOROVOD_AUTOTUNE": "1",
            "HOROVOD_AUTOTUNE_LOG": "/tmp/at.csv",
            "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "0",
            "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "4",
            "HVDPLUS_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "7",
        }
    )
    assert (s.autotune, s.autotune_log, s.autotune_warmup_samples) == (True, "/tmp/at.csv", 0)
    assert (s.autotune_steps_per_sample, s.autotune_bayes_opt_max_samples) == (4, 7)
    assert (
        Settings().autotune,
        Settings().autotune_warmup_samples,
        Settings().autotune_steps_per_sample,
        Settings().autotune_bayes_opt_max_samples,
    ) == (False, 3, 10, 20)


@pytest.mark.parametrize(
    "var,value",
    [
        ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "-1"),
        ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "0"),
        ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "0"),
    ],
)
def test_bad_autotune_values_name_the_variable(var, value):
    with pytest.raises(ValueError, match=f"{var}") as info:
        Settings.from_env({var: value})
    assert "HVDPLUS_AUTOTUNE/" not in str(info.value)  # only the setting at fault is named


def test_explicit_names_the_settings_given_by_either_name_or_override():
    s = Settings.from_env(
        {"HOROVOD_CYCLE_TIME": "2", "HVDPLUS_FUSION_THRESHOLD": "0", "HOROVOD_RANK": "1"}, hierarchical_allgather=True
    )
    assert s.explicit == {"cycle_time_ms", "fusion_threshold", "hierarchical_allgather"}
    assert Settings.from_env({}).explicit == frozenset()


def test_hierarchical_settings_and_the_cross_algorithm_is_checked():
    assert Settings.from_env({}).hierarchical_allreduce is False  # off unless asked for (or autotune tries it)
    assert Settings.from_env({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}).hierarchical_allreduce is True
    assert Settings.from_env({"HOROVOD_HIERARCHICAL_ALLGATHER": "1"}).hierarchical_allgather is True
    assert Settings.from_env({}).cross_algorithm == "auto"
    with pytest.raises(ValueError, match=r"must be one of.*\(set by environment variable HVDPLUS_CROSS_ALGORITHM\)"):
        Settings.from_env({"HVDPLUS_CROSS_ALGORITHM": "butterfly"})


def test_operations_libraries_are_named_without_case_as_in_horovod():
    """Horovod compares HOROVOD_CPU_OPERATIONS with strcasecmp, and its build instructions (often left in a
    container's environment) set HOROVOD_GPU_OPERATIONS=NCCL."""
    s = Settings.from_env({"HOROVOD_CPU_OPERATIONS": "MPI", "HOROVOD_GPU_OPERATIONS": "NCCL"})
    assert (s.cpu_operations, s.gpu_operations) == ("mpi", "nccl")
    assert Settings.from_env({"HOROVOD_CPU_OPERATIONS": "Gloo"}).cpu_operations == "gloo"
    assert Settings.from_env({"HOROVOD_GPU_OPERATIONS": "Gloo"}).gpu_operations == "gloo"  # ranks sharing a GPU
    with pytest.raises(ValueError, match="HOROVOD_GPU_OPERATIONS"):
        Settings.from_env({"HOROVOD_GPU_OPERATIONS": "RCCL"})


def test_torchrun_ranks_count_only_under_torchrun():
    """torchrun's RANK/WORLD_SIZE/LOCAL_RANK win over SLURM_* (srun torchrun numbers agents with SLURM_PROCID), and
    are ignored without TORCHELASTIC_RUN_ID (RANK alone is too common a name to trust); the agent's store is joined,
    not served again."""
    torchrun = {
        "TORCHELASTIC_RUN_ID": "x",
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    env = LaunchEnv.from_env(torchrun)
    assert (env.rank, env.size, env.local_rank, env.agent_store) == (3, 4, 1, True)
    assert (env.rendezvous_addr, env.rendezvous_port) == ("node1", 29500)
    plain = LaunchEnv.from_env({"RANK": "3", "WORLD_SIZE": "4"})
    assert (plain.rank, plain.size, plain.agent_store) == (None, None, False)
