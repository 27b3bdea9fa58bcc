"""Host lists: -H, hostfiles, Slurm's compressed node lists and task counts, and the rank -> slot assignment."""

import pytest

from hvdplus.common.settings import LaunchEnv, expand_nodelist, slurm_port
from hvdplus.runner.hosts import Host, assign_slots, parse_hostfile, parse_hosts, parse_tasks_per_node, slurm_hosts


@pytest.mark.parametrize(
    "text,hosts",
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a,b[8-10],c", ["a", "b8", "b9", "b10", "c"]),
        ("rack[1-2]-n[3,5]", ["rack1-n3", "rack1-n5", "rack2-n3", "rack2-n5"]),
        ("gpu-01", ["gpu-01"]),
    ],
)
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize(
    "text,problem",
    [
        ("node[1-3", "unbalanced"),
        ("node[3-1]", "runs backwards"),
        ("node[a-b]", "not a number"),
        ("a,,b", "empty host name"),
        ("n[[1]]", "nested"),
    ],
)
def test_expand_nodelist_rejects_bad_lists(text, problem):
    with pytest.raises(ValueError, match=problem):
        expand_nodelist(text)


@pytest.mark.parametrize("text,counts", [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2(x2)", [1, 2, 2])])
def test_parse_tasks_per_node(text, counts):
    assert parse_tasks_per_node(text) == counts


def test_parse_tasks_per_node_rejects_garbage():
    with pytest.raises(ValueError, match=r"SLURM_TASKS_PER_NODE '2\(3\)'"):
        parse_tasks_per_node("2(3)")


def test_slurm_hosts_pairs_nodes_with_counts():
    assert slurm_hosts("n[1-3]", "2(x2),1") == [Host("n1", 2), Host("n2", 2), Host("n3", 1)]
    with pytest.raises(ValueError, match="3 node"):
        slurm_hosts("n[1-3]", "2")


def test_srun_step_gets_a_rendezvous_on_its_first_node():
    env = LaunchEnv.from_env(
        {
            "SLURM_PROCID": "1",
            "SLURM_NTASKS": "4",
            "SLURM_JOB_ID": "77",
            "SLURM_STEP_ID": "2",
            "SLURM_STEP_NODELIST": "node[07-08]",
        }
    )
    assert (env.rendezvous_addr, env.rendezvous_port) == ("node07", slurm_port(77, 2))
    assert 10000 <= slurm_port(10**9, 5) < 32768
    batch_script = LaunchEnv.from_env({"SLURM_PROCID": "0", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n1"})
    assert batch_script.rendezvous_addr is None  # no step: not started by srun


def test_parse_hosts():
    assert parse_hosts("node1:4,node2:2,node3") == [Host("node1", 4), Host("node2", 2), Host("node3", 1)]


@pytest.mark.parametrize(
    "text,problem",
    [
        ("a:0", "slots must be a whole number"),
        ("a:x", "slots"),
        ("a:1,,b:1", "empty entry"),
        ("a:1,a:2", "more than once"),
        ("bad host:1", "not a host name"),
    ],
)
def test_parse_hosts_rejects_bad_entries(text, problem):
    with pytest.raises(ValueError, match=problem):
        parse_hosts(text)


def test_parse_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\nnode1 slots=4\n\nnode2 slots=2  # the small one\nnode3\n")
    assert parse_hostfile(path) == [Host("node1", 4), Host("node2", 2), Host("node3", 1)]


@pytest.mark.parametrize(
    "text,problem",
    [
        ("node1 slots=4\nnode2 4\n", "line 2 .*expected 'hostname slots=N'"),
        ("node1 slots=-1\n", "line 1 .*slots must be"),
        ("# nothing\n", "lists no hosts"),
    ],
)
def test_parse_hostfile_names_the_bad_line(tmp_path, text, problem):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem):
        parse_hostfile(path)


def test_parse_hostfile_missing_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read hostfile"):
        parse_hostfile(tmp_path / "nope")


def test_assign_slots_fills_hosts_in_order():
    slots = assign_slots([Host("a", 2), Host("b", 2)], 3)
    assert [(s.rank, s.hostname, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        (0, "a", 0, 2, 0, 2),
        (1, "a", 1, 2, 0, 1),
        (2, "b", 0, 1, 1, 2),
    ]


def test_assign_slots_cross_ranks_with_uneven_hosts():
    slots = assign_slots([Host("a", 1), Host("b", 3)], 4)
    assert [(s.hostname, s.local_rank, s.cross_rank, s.cross_size) for s in slots] == [
        ("a", 0, 0, 2),
        ("b", 0, 1, 2),
        ("b", 1, 0, 1),
        ("b", 2, 0, 1),
    ]


def test_assign_slots_refuses_more_ranks_than_slots():
    with pytest.raises(ValueError, match=r"-np 5 is more than the 4 slot\(s\) available \(a:2,b:2\)"):
        assign_slots([Host("a", 2), Host("b", 2)], 5)
    with pytest.raises(ValueError, match="-np must be a whole number"):
        assign_slots([Host("a", 2)], 0)
