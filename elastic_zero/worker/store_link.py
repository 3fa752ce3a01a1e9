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
        self._waiter: tuple | None = None  # (the client, a clone of it for long waits)

    def waiter(self):
        """A connection of its own to the current store, for one long wait at a time (a wait blocks
        its connection): made once per store, by one thread at a time (a standing call's)."""
        if self._waiter is None or self._waiter[0] is not self._client:
            self._waiter = (self._client, self._client.clone())
        return self._waiter[1]

    def switch(self, client) -> None:
        """From now on every call goes to `client` (a replacement coordinator's store)."""
        self._client = client

    def __getattr__(self, name: str):
        # set, get, add, check, wait, compare_set, clone...: the current client's
        return getattr(self._client, name)
