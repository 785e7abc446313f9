"""``blade_llm_server``'s start-up signal handling (entrypoints/cli/server.py): ``main()`` gives
an in-process caller its own SIGINT/SIGTERM handlers back, and ``cli()`` treats only an
interrupted start-up (a ``KeyboardInterrupt``, bare or wrapped) as a clean exit 0: any other
failure keeps its traceback and a non-zero status, even after a signal was received."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import types

import pytest

from bladellm.entrypoints.cli import server

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))
# Not a local folder: main() starts no engine core, and the fake run_server below loads nothing.
ARGS = ["--model", "org/not-a-local-model"]


@pytest.mark.parametrize("outcome", ["returns", "raises"])
def test_main_restores_the_callers_handlers(monkeypatch, outcome):
    seen = {}

    def run_server(engine_config, server_config, client=None):
        seen["during"] = signal.getsignal(signal.SIGTERM)
        if outcome == "raises":
            raise RuntimeError("engine core failed to start")
        return 0

    fake = types.ModuleType("bladellm.entrypoints.api_server")
    fake.run_server = run_server
    monkeypatch.setitem(sys.modules, "bladellm.entrypoints.api_server", fake)

    def mine(signum, frame):
        pass

    before = {sig: signal.signal(sig, mine) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if outcome == "raises":
            with pytest.raises(RuntimeError):
                server.main(ARGS)
        else:
            assert server.main(ARGS) == 0
        assert seen["during"] is not mine  # start-up had its own handler
        assert signal.getsignal(signal.SIGINT) is mine
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


# The script run as the server process: a fake api_server whose run_server receives SIGTERM
# during start-up (main()'s handler raises KeyboardInterrupt there), then ends as ``how`` says.
_SCRIPT = """
import os, signal, sys, time, types

how = sys.argv[1]


def run_server(engine_config, server_config, client=None):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    except KeyboardInterrupt as interrupt:
        if how == "wrapped":
            raise RuntimeError("an import wrapped it") from interrupt
    if how == "fails-after":
        raise ValueError("bad checkpoint after the signal was handled")
    return 0


fake = types.ModuleType("bladellm.entrypoints.api_server")
fake.run_server = run_server
sys.modules["bladellm.entrypoints.api_server"] = fake
sys.argv = ["blade_llm_server", "--model", "org/not-a-local-model"]
from bladellm.entrypoints.cli import server

server.cli()
"""


def _cli(how: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _SCRIPT, how], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_cli_wrapped_interrupt_exits_0_quietly():
    done = _cli("wrapped")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_cli_failure_after_a_signal_keeps_its_traceback_and_status():
    done = _cli("fails-after")
    assert done.returncode == 1, done.stderr
    assert "Traceback" in done.stderr
    assert "ValueError: bad checkpoint after the signal was handled" in done.stderr
