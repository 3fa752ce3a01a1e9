"""The user's own functions in a job (model factory, loss, collate): found by name, or shipped.

A spec names them "package.module:function" (imported where they run: on every worker) or, from
Python, holds the callables themselves, which Ray pickles with the spec. A callable from a module
that a worker cannot import by name (a script, a notebook, a test file: anything outside the
installed packages) travels by value, with its module's code.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import sysconfig
from typing import Callable

from elastic_zero.job.sealed import Sealed, UserCodeError  # noqa: F401 - UserCodeError: raised here, imported from here


def resolve(where: str, ref) -> Callable:
    """The callable a spec field names; UserCodeError (one line naming the field) if it cannot be had."""
    if isinstance(ref, Sealed):  # shipped from the driver, past the coordinator (job/sealed.py)
        ref = ref.open(where)
    if callable(ref):
        return ref
    module_name, _, fn_name = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any failure to import is the user's to see, in one line
        raise UserCodeError(f"{where}: cannot import {module_name!r} ({type(exc).__name__}: {exc})") from None
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise UserCodeError(f"{where}: module {module_name!r} has no {fn_name!r}")
    if not callable(fn):
        raise UserCodeError(f"{where}: {ref!r} is a {type(fn).__name__}, not a function")
    return fn


def _installed_roots() -> tuple[str, ...]:
    import site

    paths = sysconfig.get_paths()
    roots = [paths[k] for k in ("purelib", "platlib", "stdlib") if k in paths]
    roots += site.getsitepackages() + [site.getusersitepackages()]
    return tuple(os.path.realpath(r) for r in roots)


def _module_of(ref):
    """The module a callable's code lives in: a partial's function's, a callable object's class's."""
    while isinstance(ref, functools.partial):
        ref = ref.func
    name = getattr(ref, "__module__", None) or getattr(type(ref), "__module__", None) or ""
    return sys.modules.get(name)


def ship_by_value(*refs) -> None:
    """Let cloudpickle carry these callables by value when their code is not in an installed
    package, so that a worker started anywhere can load them (Ray pickles functions by reference
    otherwise). The whole top-level package goes, so helpers from sibling modules travel too."""
    import ray.cloudpickle as cloudpickle

    roots = _installed_roots()
    for ref in refs:
        if ref is None or isinstance(ref, str):
            continue
        module = _module_of(ref)
        if module is None or module.__name__ == "__main__" or module.__name__.split(".")[0] == "elastic_zero":
            continue  # __main__ goes by value anyway; our own package is installed wherever we run
        path = os.path.realpath(getattr(module, "__file__", "") or "")
        if path and not path.startswith(roots):
            cloudpickle.register_pickle_by_value(sys.modules.get(module.__name__.split(".")[0], module))
