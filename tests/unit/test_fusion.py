"""plan_batches: which allreduces share a fusion buffer."""

from hvdplus.common.control.messages import Request, Response
from hvdplus.common.data.fusion import plan_batches
from hvdplus.common.engines.mpi import MPIEngine
from hvdplus.common.engines.torch_dist import TorchDistEngine
from hvdplus.common.ops import OpKind, ReduceOp


def resp(name, n=4, kind=OpKind.ALLREDUCE, set_id=0, error=None, **kw):
    request = Request(name=name, kind=kind, process_set=set_id, shape=(n,), **kw)
    return Response((set_id, name), kind, (request, request), error=error, members=(0, 1))


ALONE_BYTES = MPIEngine.alone_bytes  # MPI's policy (Engine.alone_bytes); Gloo's is None


def names(batches):
    return [[r.key[1] for r in batch] for batch in batches]


def test_nbytes():
    assert resp("a", 4).nbytes == 16
    assert resp("a", 4, dtype="float16").nbytes == 8


def test_compatible_allreduces_are_fused():
    assert names(plan_batches([resp("a"), resp("b"), resp("c")], 1024, ALONE_BYTES)) == [["a", "b", "c"]]


def test_threshold_splits_batches():
    # each is 16 bytes; 40 bytes fits two
    assert names(plan_batches([resp(n) for n in "abcde"], 40, ALONE_BYTES)) == [["a", "b"], ["c", "d"], ["e"]]


def test_exactly_at_threshold_fits():
    assert names(plan_batches([resp("a"), resp("b")], 32, ALONE_BYTES)) == [["a", "b"]]


def test_oversized_response_runs_alone():
    assert names(plan_batches([resp("big", 100), resp("a")], 32, ALONE_BYTES)) == [["big"], ["a"]]


def test_large_responses_run_alone_below_the_threshold():
    """A response of ALONE_BYTES or more is reduced in place on its own (no copies in and out of a fusion
    buffer), even when the fusion threshold would take it; the small ones around it still fuse."""
    large = resp("large", ALONE_BYTES // 4)
    assert names(plan_batches([resp("a"), large, resp("b")], 128 << 20, ALONE_BYTES)) == [["a", "b"], ["large"]]
    just_below = resp("just below", ALONE_BYTES // 4 - 1)
    assert names(plan_batches([resp("a"), just_below], 128 << 20, ALONE_BYTES)) == [["a", "just below"]]


def test_without_an_alone_limit_large_responses_fuse():
    """Gloo's policy (alone_bytes None: a call costs more than copying megabytes): large responses fuse too."""
    assert TorchDistEngine.alone_bytes is None
    large = resp("large", 4 * ALONE_BYTES)
    assert names(plan_batches([resp("a"), large, resp("b")], 128 << 20, None)) == [["a", "large", "b"]]
    assert names(plan_batches([resp("a"), large, resp("b")], 4 * ALONE_BYTES, None)) == [["a", "b"], ["large"]]


def test_zero_threshold_disables_fusion():
    assert names(plan_batches([resp("a"), resp("b")], 0, ALONE_BYTES)) == [["a"], ["b"]]


def test_incompatible_allreduces_are_not_fused():
    responses = [
        resp("a"),
        resp("dt", dtype="float64"),
        resp("dev", device="cuda:0"),
        resp("op", op=ReduceOp.MAX),
        resp("pre", prescale=2.0),
        resp("post", postscale=0.5),
        resp("set", set_id=1),
        resp("b"),
    ]
    assert names(plan_batches(responses, 1 << 20, ALONE_BYTES)) == [
        ["a", "b"],
        ["dt"],
        ["dev"],
        ["op"],
        ["pre"],
        ["post"],
        ["set"],
    ]


def test_other_kinds_and_errors_run_alone():
    responses = [
        resp("a"),
        resp("g", kind=OpKind.ALLGATHER),
        resp("bad", error="mismatch"),
        resp("br", kind=OpKind.BROADCAST),
        resp("b"),
    ]
    assert names(plan_batches(responses, 1 << 20, ALONE_BYTES)) == [["a", "b"], ["g"], ["bad"], ["br"]]


def test_every_response_appears_once():
    responses = [resp(f"r{i}", n=i + 1, dtype=("float32", "float16")[i % 2]) for i in range(20)]
    batches = plan_batches(responses, 24, ALONE_BYTES)
    flat = [r for batch in batches for r in batch]
    assert sorted(r.key for r in flat) == sorted(r.key for r in responses)
    for batch in batches:
        if len(batch) > 1:
            assert sum(r.nbytes for r in batch) <= 24
