"""An elastic worker's store reads give up once the launcher replaces the generation it is connecting in (a peer
died before connecting), instead of waiting out the rendezvous timeout: a real server, a real client, torch's
Store interface as Gloo calls it."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from hvdplus.common.elastic.plan import LATEST_KEY, GenerationReplaced  # noqa: E402
from hvdplus.common.engines.torch_store import authenticated_store  # noqa: E402
from hvdplus.common.rendezvous import RendezvousServer, RendezvousTimeout, new_secret  # noqa: E402
from hvdplus.common.settings import LaunchEnv  # noqa: E402


def _store(server: RendezvousServer, secret: str, **elastic: object):
    launch = LaunchEnv(
        rank=0,
        size=2,
        rendezvous_addr="127.0.0.1",
        rendezvous_port=server.port("127.0.0.1"),
        secret_key=secret,
        **elastic,
    )
    return authenticated_store(dist, launch, timeout_seconds=20)


def test_a_read_in_a_replaced_generation_raises_at_once_and_others_still_wait():
    secret = new_secret()
    server = RendezvousServer(["127.0.0.1"], secret)
    try:
        server.put(LATEST_KEY, b"1")
        inner = _store(server, secret, elastic_worker="a/0", elastic_generation=1)  # torch keeps only its C++ half
        store = dist.PrefixStore("elastic/g1", inner)
        server.put("elastic/g1/ready", b"yes")
        assert store.get("ready") == b"yes"
        threading.Timer(0.3, server.put, args=(LATEST_KEY, b"2")).start()
        start = time.monotonic()
        with pytest.raises(Exception, match="generation 1 of the elastic job was replaced"):
            store.get("never.set")  # raised through torch's C++ trampoline
        assert time.monotonic() - start < 2.0
        with pytest.raises(GenerationReplaced):
            _store(server, secret, elastic_worker="a/0", elastic_generation=1).get("never.set")
    finally:
        server.close()


def test_outside_elastic_jobs_a_read_waits_for_the_whole_timeout():
    secret = new_secret()
    server = RendezvousServer(["127.0.0.1"], secret)
    try:
        launch = LaunchEnv(
            rank=0, size=2, rendezvous_addr="127.0.0.1", rendezvous_port=server.port("127.0.0.1"), secret_key=secret
        )
        store = authenticated_store(dist, launch, timeout_seconds=1)
        start = time.monotonic()
        with pytest.raises(RendezvousTimeout):
            store.get("never.set")
        assert time.monotonic() - start >= 0.9
    finally:
        server.close()
