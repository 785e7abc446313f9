"""A check's outcome and the report format: ``name STATUS detail`` lines and a summary."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

PASS, WARNING, FAILED = "PASS", "WARNING", "FAILED"
STATUSES = (PASS, WARNING, FAILED)


@dataclass(frozen=True)
class CheckResult:
    name: str  # one word: the first field of the report line
    status: str  # PASS, WARNING or FAILED
    detail: str

    def __post_init__(self) -> None:
        if self.status not in STATUSES or not self.name or " " in self.name:
            raise ValueError(f"bad check result {self.name!r} {self.status!r}")

    def line(self) -> str:
        return f"{self.name} {self.status} {self.detail}"


def summary(results: Sequence[CheckResult]) -> dict[str, int]:
    return {s: sum(r.status == s for r in results) for s in STATUSES}


def exit_code(results: Sequence[CheckResult]) -> int:
    """0 only when nothing failed."""
    return 1 if summary(results)[FAILED] else 0


def format_text(results: Sequence[CheckResult]) -> str:
    counts = summary(results)
    lines = [r.line() for r in results]
    lines.append(", ".join(f"{s} {counts[s]}" for s in STATUSES))
    return "\n".join(lines)


def format_json(results: Sequence[CheckResult]) -> str:
    return json.dumps({"checks": [asdict(r) for r in results], "summary": summary(results),
                       "ok": exit_code(results) == 0}, indent=2)
