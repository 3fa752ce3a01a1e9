"""The event log's kinds are declared once (observe/event_kinds.py). Oracle: the source itself, read
as syntax: every kind the coordinator writes, with the fields it names, and every kind a reader
compares a record against, in the package and in the tests, is in the table; and the log refuses
what is not."""

import ast
import os

import pytest

from elastic_zero.observe.event_kinds import KINDS
from elastic_zero.observe.event_log import EventLog

pytestmark = pytest.mark.unit

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _sources():
    for top in ("elastic_zero", "tests"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py") and name != "test_event_kinds.py":
                    path = os.path.join(dirpath, name)
                    yield os.path.relpath(path, ROOT), ast.parse(open(path).read())


def _strings(node) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e)]
    return []


def _names_of_events(tree) -> set[str]:
    """Names bound to a record's kind (`kind = r.get("event")`, `kind, r = record.get("event"), record`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                         and isinstance(node.value, ast.Tuple) else [(target, node.value)])
                names |= {t.id for t, v in pairs if isinstance(t, ast.Name) and _is_event_of_a_record(v)}
    return names


def _is_event_of_a_record(node, names=frozenset()) -> bool:
    """r["event"], r.get("event"), or a name bound to one of them."""
    if isinstance(node, ast.Name) and node.id in names:
        return True
    if isinstance(node, ast.Subscript) and _strings(node.slice) == ["event"]:
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
            and node.args and _strings(node.args[0]) == ["event"]:
        return True
    return False


def _written_and_read():
    written, read = [], []
    for path, tree in _sources():
        names = _names_of_events(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                kind = _strings(node.args[0])
                if node.func.attr in ("log", "_log") and kind:  # the coordinator's parts write through log()
                    written.append((f"{path}:{node.lineno}", kind[0], [k.arg for k in node.keywords if k.arg]))
                if node.func.attr == "count" and kind and isinstance(node.func.value, ast.Attribute) \
                        and node.func.value.attr == "events":
                    read.append((f"{path}:{node.lineno}", kind[0]))
            if isinstance(node, ast.Call):  # events.wait(..., event="generation_start"), in the benches
                for keyword in node.keywords:
                    if keyword.arg == "event":
                        read += [(f"{path}:{node.lineno}", s) for s in _strings(keyword.value)]
            if isinstance(node, ast.Compare):
                sides = [node.left] + list(node.comparators)
                if any(_is_event_of_a_record(side, names) for side in sides):
                    read += [(f"{path}:{node.lineno}", s) for side in sides for s in _strings(side)]
    return written, read


def test_every_kind_written_and_each_field_it_names_is_declared():
    written, _ = _written_and_read()
    assert len(written) > 30  # the coordinator's writers were found
    for where, kind, fields in written:
        assert kind in KINDS, f"{where}: {kind!r} is not declared"
        assert set(fields) <= KINDS[kind].fields, f"{where}: {kind!r} names {sorted(set(fields) - KINDS[kind].fields)}"


def test_every_kind_a_reader_compares_against_is_declared():
    _, read = _written_and_read()
    assert len(read) > 40  # the readers were found
    assert any(where.startswith("elastic_zero/observe/progress.py") for where, _ in read)  # through `kind`
    unknown = [(where, kind) for where, kind in read if kind not in KINDS]
    assert not unknown, unknown


def test_the_log_refuses_a_kind_or_a_field_not_declared_and_writes_nothing_then(tmp_path):
    log = EventLog(str(tmp_path))
    log.add("worker_lost", actor_id="w1", error="killed")
    with pytest.raises(ValueError, match=r"event kind 'worker_gone' is not declared"):
        log.add("worker_gone", actor_id="w1")
    with pytest.raises(ValueError, match=r"event 'worker_lost': field\(s\) \['node'\] not declared"):
        log.add("worker_lost", actor_id="w1", node="n1")
    assert [r["event"] for r in log.records] == ["worker_lost"]
    assert len(open(log.path).read().splitlines()) == 1
