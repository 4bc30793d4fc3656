"""Servers for the end-to-end tests forked from a process that has already imported what a server
imports (``python -m tests.support.zygote``), rather than each a new interpreter importing torch,
transformers and the gateway again: ~3.6 s of CPU a start, ~70 starts a run on a 2-core machine.
The processes such a server starts with ``python -c`` (multiprocessing's: the workers' fork
server, the resource tracker) are forked the same way (``_fork_python``), and so find what the
fork server preloads already imported (~2 s of CPU more a start).

The forked child is then what ``python -m hosted_tinker <argv>`` is: ``runpy`` runs the package's
``__main__`` as the main module (what a worker process imports of it is the same), with the
caller's environment, working directory and output files; it exits through the interpreter's
normal shutdown. The zygote stays single-threaded (it forks), reaps its children and reports each
one's exit status, so the caller's handle answers as ``subprocess.Popen`` does.

Protocol, one JSON object a line: the caller writes ``{"argv", "env", "cwd", "stdout", "stderr"}``
and reads ``{"started": pid}`` in answer, and ``{"exited": pid, "code": returncode}`` whenever
a child ends (a signal's as ``-signum``, as Popen says it)."""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing.util
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class ForkedProcess:
    """A zygote's child, as much of ``subprocess.Popen`` as the tests use."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self._zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout=timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not a pid that may since be another process's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The caller's side: one zygote per test process, started on first use."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO
        )
        self._started: list[int] = []
        self._exits: dict[int, int] = {}
        self._gone = False
        self._changed = threading.Condition()
        self._spawning = threading.Lock()  # one request in flight: answers come in request order
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def spawn(self, argv: list[str], stdout: Path, stderr: Path | None = None) -> ForkedProcess:
        """``python -m hosted_tinker *argv`` forked, its output to ``stdout`` (and ``stderr``, else
        there too), in this process's environment and working directory."""
        request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "stdout": str(stdout)}
        request["stderr"] = str(stderr or stdout)
        assert self._proc.stdin is not None
        with self._spawning:
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
            with self._changed:
                if not self._changed.wait_for(lambda: self._started or self._gone, timeout=60) or self._gone:
                    raise RuntimeError(f"the test zygote did not fork (it exited with {self._proc.poll()})")
                pid = self._started.pop(0)
        return ForkedProcess(self, pid, [sys.executable, "-m", "hosted_tinker", *argv])

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or self._gone, timeout=timeout)
            if pid not in self._exits and self._gone:
                raise RuntimeError("the test zygote has exited: its children's ends are no longer known")
            return self._exits.get(pid)

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._changed:
                if "started" in message:
                    self._started.append(message["started"])
                else:
                    self._exits[message["exited"]] = message["code"]
                self._changed.notify_all()
        with self._changed:
            self._gone = True
            self._changed.notify_all()


_zygote: Zygote | None = None


def zygote() -> Zygote:
    global _zygote
    if _zygote is None or _zygote._gone:
        _zygote = Zygote()
    return _zygote


# The zygote's side.


def _report(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()  # before any fork: a child must not inherit a buffered line


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _report({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


_spawnv_passfds = multiprocessing.util.spawnv_passfds


def _fork_python(path: str, args: list[str], passfds: tuple[int, ...]) -> int:
    """``multiprocessing.util.spawnv_passfds`` of ``python -c CODE``, forked: the child closes what
    a new process would not have, lets go of the server's logging (a new interpreter has none),
    runs CODE and exits without the server's exit handlers."""
    if "-c" not in args:
        return _spawnv_passfds(path, args, passfds)
    code = args[args.index("-c") + 1]
    pid = os.fork()
    if pid:
        return pid
    status = 0
    try:
        keep = sorted({2, *passfds})
        for low, high in zip([2, *keep], [*keep, os.sysconf("SC_OPEN_MAX")], strict=True):
            os.closerange(low + 1, high)
        logging.root.handlers.clear()
        logging.root.setLevel(logging.WARNING)
        sys.argv = ["-c"]
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        status = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed by CODE (the resource tracker closes stdout)
                pass
        os._exit(status)  # never back into the caller's frames


def _become(request: dict, wake: tuple[int, int]) -> None:
    """In the forked child: the zygote's pipes and signal handling let go, then the CLI."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in wake:
        os.close(fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    same = request["stderr"] == request["stdout"]
    err = out if same else os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    multiprocessing.util.spawnv_passfds = _fork_python
    sys.argv = ["hosted_tinker", *request["argv"]]
    runpy.run_module("hosted_tinker", run_name="__main__", alter_sys=True)  # raises SystemExit


def main() -> None:
    # What `serve` imports (hosted_tinker/cli.py `_serve`), so that a fork has it all.
    import uvicorn  # noqa: F401

    import hosted_tinker.cli  # noqa: F401  (not its __main__, which runpy runs as the main module)
    import hosted_tinker.server.api.app  # noqa: F401
    import hosted_tinker.server.api.connections  # noqa: F401
    import hosted_tinker.server.api.request_log  # noqa: F401
    import hosted_tinker.server.api.state  # noqa: F401
    from hosted_tinker.core.processes import PRELOAD

    for module in PRELOAD:  # what the workers' fork server imports; not the one that ignores SIGTERM
        if module != "hosted_tinker.rank.fork_server":
            importlib.import_module(module)

    wake = os.pipe()
    os.set_blocking(wake[1], False)
    signal.set_wakeup_fd(wake[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below through the pipe
    pending = b""
    while True:
        ready, _, _ = select.select([0, wake[0]], [], [])
        if wake[0] in ready:
            os.read(wake[0], 4096)
        _reap()
        if 0 not in ready:
            continue
        chunk = os.read(0, 1 << 20)
        if not chunk:  # the test process has gone
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                _become(json.loads(line), wake)
            _report({"started": pid})


if __name__ == "__main__":
    main()
