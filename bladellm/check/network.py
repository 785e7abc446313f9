"""The port the server (or router) will listen on is free."""

from __future__ import annotations

import socket

from bladellm.check.result import FAILED, PASS, CheckResult


def check_port(host: str, port: int) -> CheckResult:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            s.bind((host, port))
        except OSError as exc:
            return CheckResult(f"port_{port}", FAILED, f"cannot listen on {host}:{port}: "
                                                       f"{exc.strerror or exc}")
    return CheckResult(f"port_{port}", PASS, f"{host}:{port} is free")
