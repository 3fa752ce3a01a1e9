"""The docs: the spec reference is what the code generates (no drift), every field has a description,
and every relative link in the Markdown files points to a file that exists (and to a heading that
exists, when it names one)."""

import dataclasses
import glob
import os
import re

import pytest

from elastic_zero.job.spec import _SECTIONS
from elastic_zero.job.reference import field_docs, spec_reference
from elastic_zero.job.sections import FaultSpec

pytestmark = pytest.mark.unit

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), ".."))
MARKDOWN = sorted(glob.glob(os.path.join(ROOT, "*.md")) + glob.glob(os.path.join(ROOT, "docs", "*.md"))
                  + glob.glob(os.path.join(ROOT, "deploy", "**", "*.md"), recursive=True))
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_the_spec_reference_is_the_generated_one():
    with open(os.path.join(ROOT, "docs", "spec.md")) as fh:
        assert fh.read() == spec_reference(), "docs/spec.md drifted: python -m elastic_zero.job.reference > docs/spec.md"


def test_every_spec_field_has_a_description_in_the_code():
    for cls in list(_SECTIONS.values()) + [FaultSpec]:
        docs = field_docs(cls)
        assert [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)] == [], cls.__name__


def _anchors(path: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    with open(path) as fh:
        headings = [line.lstrip("#").strip() for line in fh if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def _broken_links(paths) -> list[str]:
    broken = []
    for path in paths:
        with open(path) as fh:
            text = re.sub(r"```.*?```", "", fh.read(), flags=re.S)  # not links inside code blocks
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file_part, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            if not os.path.exists(resolved):
                broken.append(f"{os.path.basename(path)}: {target} (no such file)")
            elif anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
                broken.append(f"{os.path.basename(path)}: {target} (no such heading)")
    return broken


def test_every_relative_link_resolves():
    assert len(MARKDOWN) >= 6
    assert _broken_links(MARKDOWN) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    """The oracle above can fail."""
    (tmp_path / "other.md").write_text("# A heading, here\n")
    page = tmp_path / "page.md"
    page.write_text("[a](design.md) [b](#nowhere) [c](other.md#a-heading-here) [d](other.md#gone) [e](#here)\n"
                    "```\n[f](inside-code.md)\n```\n# Here\n")
    assert _broken_links([str(page)]) == ["page.md: design.md (no such file)", "page.md: #nowhere (no such heading)",
                                          "page.md: other.md#gone (no such heading)"]
