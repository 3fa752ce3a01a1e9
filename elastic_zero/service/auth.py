"""Ray's token authentication, as seen from a client.

Ray 2.60's `ray start --head` turns token auth on when a token exists (RAY_AUTH_TOKEN,
RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token). Its own CLI, with RAY_AUTH_MODE unset, sends the token it
finds; its Python clients send one only when RAY_AUTH_MODE=token. use_cluster_token() does what
the CLI does, so `elastic-zero` and `Client` work against either kind of head without settings.
"""

from __future__ import annotations

import os

AUTH_HELP = ("set RAY_AUTH_MODE=token and give the cluster's token in RAY_AUTH_TOKEN, in a file named by "
             "RAY_AUTH_TOKEN_PATH, or in ~/.ray/auth_token (`ray get-auth-token` on the head prints it)")


def token_source() -> str | None:
    """Where a token would come from, in Ray's order; None when there is none."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    for path in (os.environ.get("RAY_AUTH_TOKEN_PATH"), os.path.expanduser("~/.ray/auth_token")):
        if path and os.path.isfile(path):
            return path
    return None


def use_cluster_token() -> str | None:
    """Send the token found (as Ray's CLI does) when RAY_AUTH_MODE is unset. Returns its source."""
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return None
    source = token_source()
    if source is None:
        return None
    os.environ["RAY_AUTH_MODE"] = "token"
    try:  # Ray reads its mode once into a cached config: refresh it (private; harmless where absent)
        from ray._raylet import Config

        Config.initialize("")
    except Exception:  # noqa: BLE001
        pass
    return source


def explain(exc: BaseException, address: str) -> str:
    """One line for a failure to talk to the cluster at `address`."""
    text = str(exc)
    lowered = text.lower()
    if "authentication required" in lowered or "missing authentication token" in lowered or "401" in lowered and "unauthorized" in lowered:
        return f"the Ray cluster at {address} requires a token and none was sent: {AUTH_HELP}"
    if "authentication failed" in lowered or "invalid authentication token" in lowered or "forbidden" in lowered:
        return f"the Ray cluster at {address} rejected the token ({token_source() or 'none found'}): {AUTH_HELP}"
    if isinstance(exc, ConnectionError) or "failed to connect" in lowered or "connection refused" in lowered:
        if "://" not in address:  # a GCS address (HOST:PORT): a direct connection, not the Jobs API
            return (f"cannot reach the Ray cluster at {address}: is the cluster up, and is this its GCS address "
                    f"(HEAD:6379)?")
        return (f"cannot reach the Ray dashboard at {address}: is the cluster up, and is this its dashboard address "
                f"(http://HEAD:8265)?")
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"{first} (Ray cluster at {address})"
