"""Output-directory helpers shared by the offline tools (``blade_llm_quantize``,
``blade_llm_split``): what a run created, so that a failed run can remove it again."""

from __future__ import annotations

import os


def first_missing(path: str) -> str | None:
    """The outermost directory of ``path`` that does not exist yet (what ``os.makedirs`` will
    create), or None when ``path`` exists."""
    path = os.path.abspath(path)
    missing = None
    while not os.path.exists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def same_dir(a: str, b: str) -> bool:
    """Whether two paths (``~`` expanded, links resolved) name the same directory."""
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))
