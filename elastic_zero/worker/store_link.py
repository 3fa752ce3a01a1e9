"""The job's store as a worker's parts use it, wherever the coordinator of the moment serves it.

Each part (the groups, the checkpoint writer, the drills, the entry) is given this link, not a
client: every call goes to the current client, a torch TCPStore (through the worker's local relay,
wire/rendezvous.py). A coordinator that replaces a lost one serves a store of its own; when it takes
the worker over, the worker connects to that store and switches the link (worker/takeover.py), and
every part follows. A connection torch made cannot be pointed elsewhere: torch's client does not
reconnect, so a new one is made."""

from __future__ import annotations


class StoreLink:
    def __init__(self, client) -> None:
        self._client = client
        self._waiter = client.clone()  # made now, while this store is there: waiter() says why

    def waiter(self):
        """A connection of its own to the current store, for one long wait at a time (a wait blocks
        its connection; a standing call's thread uses it). Made with the link and at each switch,
        while that store is there. Made when a standing call first needed it (after the worker's
        first generation on a store), it was asked of a store gone with its coordinator where that
        loss ended the generation, and torch's client tries to connect for its whole timeout (the
        collective timeout) before it gives up: the replacement's take-over waited for that call
        (tests/test_coordinator_takeover.py: a 48 s stall, 1 s now)."""
        return self._waiter

    def switch(self, client) -> None:
        """From now on every call goes to `client` (a replacement coordinator's store)."""
        self._client, self._waiter = client, client.clone()

    def __getattr__(self, name: str):
        # set, get, add, check, wait, compare_set, clone...: the current client's
        return getattr(self._client, name)
