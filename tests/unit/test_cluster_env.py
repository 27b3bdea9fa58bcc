"""runner/cluster_env.py: Horovod's deprecated min_np/max_np, as hvdplus.ray's and hvdplus.spark's elastic entry
points take them, and the rank variables every Gloo rank reads, whoever started it."""

import warnings

import pytest

from hvdplus.runner.cluster_env import deprecated_bounds, place_by_host, rank_env, rank_variables


def public_entry(**bounds):
    """Stands for run_elastic / ElasticRaySettings: the warning names the caller of this function."""
    return deprecated_bounds(
        bounds.get("min_num_proc"), bounds.get("max_num_proc"), bounds.get("min_np"), bounds.get("max_np")
    )


def test_the_deprecated_names_win_with_a_warning_at_the_callers_line():
    assert public_entry(min_num_proc=1, max_num_proc=4) == (1, 4)
    with pytest.warns(DeprecationWarning, match="min_np is deprecated, use min_num_proc") as caught:
        assert public_entry(min_num_proc=1, min_np=2, max_num_proc=4) == (2, 4)
    assert caught[0].filename == __file__
    with pytest.warns(DeprecationWarning, match="max_np is deprecated, use max_num_proc"):
        assert public_entry(max_np=3) == (None, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        public_entry(min_num_proc=2)  # no warning without the old names


def test_a_cluster_engines_rank_reads_the_same_variables_as_hvdplusruns_on_gloo():
    slot = place_by_host(["a", "b", "a"])[2]
    common = rank_variables(slot, "10.0.0.1", 1234, "s3cret")
    assert common["HOROVOD_RANK"] == "1" and common["HOROVOD_LOCAL_RANK"] == "1" and common["HOROVOD_CROSS_RANK"] == "0"
    assert (common["HVDPLUS_RENDEZVOUS_ADDR"], common["HVDPLUS_RENDEZVOUS_PORT"]) == ("10.0.0.1", "1234")
    env = rank_env(slot, "10.0.0.1", 1234, "s3cret", ["eth1"])
    assert env == {**common, "HVDPLUS_CPU_OPERATIONS": "gloo", "GLOO_SOCKET_IFNAME": "eth1"}
