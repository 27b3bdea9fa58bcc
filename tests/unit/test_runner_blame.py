"""The launcher blames the rank that failed first, not the peers whose errors are its consequence."""

from hvdplus.runner.blame import Blame

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
    assert (cause.rank, cause.line) == (1, "no answer to the control rounds (frozen or hung)")
    assert blame.consequences(cause) == [0, 2]
