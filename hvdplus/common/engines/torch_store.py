"""The Gloo engine's store on hvdplusrun's rendezvous server: a torch.distributed Store whose every request is
HMAC-authenticated with the job's secret, and whose reads, in an elastic job, give up once the launcher has replaced
the generation."""

from __future__ import annotations

import time
from typing import Any

from hvdplus.common.elastic.plan import LATEST_KEY, GenerationReplaced
from hvdplus.common.settings import LaunchEnv

__all__ = ["authenticated_store"]

_SUPERSEDED_POLL_SECONDS = 0.5  # an elastic worker's store reads look this often for a newer generation


def authenticated_store(dist: Any, launch: LaunchEnv, timeout_seconds: float) -> Any:
    """A torch.distributed Store backed by hvdplusrun's rendezvous server (HMAC-authenticated). In an elastic job
    its blocking reads give up as soon as the launcher replaces this generation (a peer died before connecting):
    the worker then joins the next one instead of waiting out the timeout."""
    from hvdplus.common.rendezvous import RendezvousClient, RendezvousTimeout

    class AuthenticatedStore(dist.Store):
        def __init__(self, client: RendezvousClient) -> None:
            super().__init__()
            self._client = client
            self._clones: list[AuthenticatedStore] = []  # torch keeps only their C++ half

        def set(self, key: str, value: Any) -> None:
            self._client.set(key, value.encode() if isinstance(value, str) else bytes(value))

        def get(self, key: str) -> bytes:
            if not launch.elastic_worker:
                return self._client.get(key)
            deadline = time.monotonic() + self._client.timeout
            while True:  # in slices, looking for a newer generation in between
                try:
                    return self._client.get(key, min(_SUPERSEDED_POLL_SECONDS, self._client.timeout))
                except RendezvousTimeout:
                    if int(self._client.get(LATEST_KEY)) > launch.elastic_generation:
                        raise GenerationReplaced(
                            f"generation {launch.elastic_generation} of the elastic job was "
                            f"replaced while its workers connected (waiting for {key})"
                        ) from None
                    if time.monotonic() > deadline:
                        raise

        def add(self, key: str, amount: int) -> int:
            return self._client.add(key, amount)

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            as_bytes = lambda v: v.encode() if isinstance(v, str) else bytes(v)  # noqa: E731
            return self._client.compare_set(key, as_bytes(expected), as_bytes(desired))

        def wait(self, keys: list[str], timeout: Any = None) -> None:
            self._client.wait(keys, None if timeout is None else timeout.total_seconds())

        def check(self, keys: list[str]) -> bool:
            return self._client.check(keys)

        def delete_key(self, key: str) -> bool:
            return self._client.delete(key)

        def num_keys(self) -> int:
            return self._client.num_keys()

        def clone(self) -> AuthenticatedStore:
            clone = AuthenticatedStore(self._client.clone())
            self._clones.append(clone)
            return clone

    # _new_store calls this only with all three set
    assert launch.rendezvous_addr and launch.rendezvous_port and launch.secret_key
    return AuthenticatedStore(
        RendezvousClient(launch.rendezvous_addr, launch.rendezvous_port, launch.secret_key, timeout_seconds)
    )
