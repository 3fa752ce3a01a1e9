"""The user's own values in a job spec (a model factory, a loss, a collate, an object among a
factory's kwargs), sealed by the driver and opened only where they are used: on the workers.

Ray unpickles an actor's arguments before its constructor runs. A spec that held the user's
callables themselves made the coordinator import whatever their modules import (torch and
transformers, for a Hugging Face factory: 2-3 s of CPU before it could spawn a worker, and a
failure on a head node without the user's libraries). Sealed, such a value is bytes to the
coordinator, which passes it on unopened; the workers' builders open it (job/user_code.py).
"""

from __future__ import annotations

_PLAIN = (str, int, float, bool, type(None))


class UserCodeError(ValueError):
    """A function or value of the user's cannot be had where it is needed: one line naming the field."""


class Sealed:
    """A value pickled (with Ray's cloudpickle, so by value where `ship_by_value` said so) and
    loaded the first time it is opened. Callable, so that a sealed function passes the spec's
    checks of a function where it is not opened."""

    __slots__ = ("blob", "name", "_value")

    def __init__(self, blob: bytes, name: str) -> None:
        self.blob, self.name = blob, name

    def __reduce__(self):
        return Sealed, (self.blob, self.name)

    def __repr__(self) -> str:
        return self.name

    def __call__(self, *args, **kwargs):
        return self.open(self.name)(*args, **kwargs)

    def open(self, where: str):
        """The value; UserCodeError (one line naming `where`) if it cannot be loaded here."""
        try:
            return self._value
        except AttributeError:
            pass
        import ray.cloudpickle as cloudpickle

        try:
            self._value = cloudpickle.loads(self.blob)
        except Exception as exc:  # noqa: BLE001 - a module the worker lacks, say: the user's to see
            raise UserCodeError(f"{where}: cannot load {self.name} here ({type(exc).__name__}: {exc})") from None
        return self._value


def _plain(value) -> bool:
    """Data the coordinator may unpickle: these exact types (a str Enum, a namedtuple or an
    OrderedDict would import the module that defines it)."""
    if type(value) in _PLAIN:
        return True
    if type(value) in (list, tuple):
        return all(_plain(v) for v in value)
    return type(value) is dict and all(type(k) is str and _plain(v) for k, v in value.items())


def _name(value) -> str:
    module = getattr(value, "__module__", None) or type(value).__module__
    qualname = getattr(value, "__qualname__", None) or type(value).__qualname__
    return f"{module}:{qualname}" if callable(value) and hasattr(value, "__qualname__") else f"a {qualname} ({module})"


def seal(value) -> Sealed:
    import ray.cloudpickle as cloudpickle

    return Sealed(cloudpickle.dumps(value), _name(value))


def sealed_tables(spec: dict) -> dict:
    """The spec's tables (JobSpec.to_dict) with every value that is not plain data sealed: a field's
    own, or one in a table a field holds (a factory's kwargs). SpecError names a value that cannot
    be pickled."""
    def sealed(where: str, value):
        if _plain(value) or isinstance(value, Sealed):
            return value
        try:
            return seal(value)
        except Exception as exc:  # noqa: BLE001 - a lock, a socket, an open file: the user's to see
            from elastic_zero.job.spec import SpecError

            raise SpecError(f"{where}: cannot be sent to the workers ({type(exc).__name__}: {exc})") from None

    def field_value(where: str, value):
        if type(value) is dict and not _plain(value):
            return {k: sealed(f"{where}.{k}", v) for k, v in value.items()}
        return sealed(where, value)

    return {section: {k: field_value(f"{section}.{k}", v) for k, v in table.items()} if type(table) is dict else table
            for section, table in spec.items()}


def opened(where: str, table: dict) -> dict:
    """A table (a factory's kwargs) with its sealed values opened."""
    return {k: v.open(f"{where}.{k}") if isinstance(v, Sealed) else v for k, v in table.items()}
