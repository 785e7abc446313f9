"""Python and package versions against what the installed ``bladellm`` declares it needs."""

from __future__ import annotations

import platform
from importlib import metadata

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet

from bladellm.check.result import FAILED, PASS, WARNING, CheckResult

KEY_PACKAGES = ("torch", "transformers")


def _requirements() -> list[Requirement] | None:
    try:
        raw = metadata.requires("bladellm") or []
    except metadata.PackageNotFoundError:
        return None
    reqs = []
    for text in raw:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            reqs.append(req)  # the core dependencies (extras are optional)
    return reqs


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _judge(req: Requirement) -> CheckResult:
    version = _installed(req.name)
    spec = str(req.specifier) or "any version"
    if version is None:
        return CheckResult(req.name, FAILED, f"not installed (needs {spec})")
    if req.specifier and not req.specifier.contains(version, prereleases=True):
        return CheckResult(req.name, FAILED, f"{version} installed, needs {spec}")
    return CheckResult(req.name, PASS, f"{version} (needs {spec})")


def check_python() -> CheckResult:
    version = platform.python_version()
    try:
        needed = metadata.metadata("bladellm").get("Requires-Python") or ""
    except metadata.PackageNotFoundError:
        needed = ""
    if needed and not SpecifierSet(needed).contains(version):
        return CheckResult("python", FAILED, f"{version}, needs {needed}")
    return CheckResult("python", PASS, f"{version} (needs {needed or 'any'})")


def check_packages() -> list[CheckResult]:
    """One line each for torch and transformers, one for all other dependencies."""
    reqs = _requirements()
    if reqs is None:
        return [CheckResult("packages", WARNING, "bladellm is not installed (running from a "
                                                 "checkout?): its requirements are unknown")]
    by_name = {r.name.lower(): r for r in reqs}
    results = [_judge(by_name[n]) for n in KEY_PACKAGES if n in by_name]
    others = [_judge(r) for n, r in sorted(by_name.items()) if n not in KEY_PACKAGES]
    bad = [r for r in others if r.status != PASS]
    if bad:
        results.append(CheckResult("dependencies", FAILED,
                                   "; ".join(f"{r.name}: {r.detail}" for r in bad)))
    else:
        results.append(CheckResult("dependencies", PASS,
                                   f"all {len(others)} other requirements satisfied"))
    return results
