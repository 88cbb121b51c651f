"""Run a command under the lock, as ``postgres-mutex run`` does: the way a careful shell would.

- The command runs in a process group of its own; every signal the
  supervisor gets (SIGINT, SIGTERM, SIGHUP) goes to that group, once, even
  one that arrives while the command is being started.
- On a terminal, the command's group becomes the foreground one, so Ctrl-C
  and Ctrl-Z reach it directly; when Ctrl-Z stops it, the supervisor stops
  too and gives the terminal back, and resumes it on ``fg``.
- The lock is held until the whole group has exited, background processes
  included (as flock(1) holds its lock while any process keeps the file).
- When the lock is lost, the group gets SIGTERM at once and SIGKILL
  ``kill_after`` seconds later, and the supervisor waits until it is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from types import FrameType

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_TICK = 0.05


class Supervisor:
    """One run of one command. ``lock_lost`` is polled: True once the lock must be given up."""

    def __init__(self, command: list[str], *, env: Mapping[str, str], lock_lost: Callable[[], bool]) -> None:
        self._command = command
        self._env = dict(env)
        self._lock_lost = lock_lost
        self._child: subprocess.Popen[bytes] | None = None
        self._pending: list[int] = []
        self._terminal: int | None = None
        self.received: list[int] = []
        """The signals the supervisor got (and forwarded) while the command ran, in order."""

    def _found(self) -> bool:
        """Whether the command names a file, found as the kernel would look it up (by PATH, if no slash)."""
        name = self._command[0]
        if os.sep in name:
            return os.path.lexists(name)
        return shutil.which(name, mode=os.F_OK, path=self._env.get("PATH", os.defpath)) is not None

    def run(self, kill_after: float, say: Callable[[str], None]) -> tuple[int, bool]:
        """Run the command to its end; returns (exit code, whether the lock was lost meanwhile).

        The exit code is the command's own, 128 + N if it died of signal N,
        127 if it was not found, 126 if it could not be executed.
        """
        # Handlers first: a signal arriving while the command starts is kept for it.
        previous = {signum: signal.signal(signum, self._forward) for signum in FORWARDED}
        try:
            try:
                self._child = subprocess.Popen(self._command, process_group=0, env=self._env)
            except FileNotFoundError as exc:
                if not self._found():
                    say(f"command not found: {self._command[0]}")
                    return 127, False
                # The command is there; what is missing is its #! interpreter.
                say(f"command could not be executed: {self._command[0]}: bad interpreter ({exc.strerror or exc})")
                return 126, False
            except OSError as exc:
                # Found, but the kernel would not run it: not executable, no #! line
                # (ENOEXEC), a directory, a bad interpreter... 126, as a shell says.
                say(f"command could not be executed: {self._command[0]}: {exc.strerror or exc}")
                return 126, False
            try:
                self._terminal = _give_terminal(self._child.pid)
                for signum in self._pending:
                    self._signal_group(signum)
                return self._wait(kill_after, say)
            except BaseException:
                # Whatever went wrong here, the command must not outlive our hold.
                self._kill_group()
                raise
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            _take_terminal_back(self._terminal)

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        if self._child is None:
            self._pending.append(signum)
        else:
            self._signal_group(signum)

    def _signal_group(self, signum: int) -> None:
        assert self._child is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._child.pid, signum)
            if signum in (signal.SIGTERM, signal.SIGHUP):
                os.killpg(self._child.pid, signal.SIGCONT)  # a stopped command must be able to act on it

    def _group_alive(self) -> bool:
        assert self._child is not None
        try:
            os.killpg(self._child.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _wait(self, kill_after: float, say: Callable[[str], None]) -> tuple[int, bool]:
        child = self._child
        assert child is not None
        returncode: int | None = None
        announced = False
        while True:
            if self._lock_lost():
                say("the lock was lost: stopping the command")
                self._stop(kill_after, say)
                code = child.returncode if returncode is None else returncode
                return _exit_status(code if code is not None else -signal.SIGKILL), True
            if returncode is None:
                self._follow_job_control()
                returncode = child.poll()
            if returncode is not None:
                _reap_orphans()
                if not self._group_alive():
                    return _exit_status(returncode), False
                if not announced:
                    say("the command exited; waiting for the processes it left running (the lock is kept)")
                    announced = True
            time.sleep(_TICK)

    def _follow_job_control(self) -> None:
        """Ctrl-Z stopped the command: stop too, and give the terminal back, as a shell expects."""
        child = self._child
        assert child is not None
        if self._terminal is None:
            return
        try:
            stopped = os.waitid(os.P_PID, child.pid, os.WSTOPPED | os.WNOHANG)
        except ChildProcessError:
            return
        if stopped is None:
            return
        _take_terminal_back(self._terminal)
        os.kill(os.getpid(), signal.SIGSTOP)
        # Resumed (fg): the command gets the terminal back and runs on.
        self._terminal = _give_terminal(child.pid)
        self._signal_group(signal.SIGCONT)

    def _stop(self, kill_after: float, say: Callable[[str], None]) -> None:
        assert self._child is not None
        self._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + kill_after
        while time.monotonic() < deadline:
            self._child.poll()
            _reap_orphans()
            if not self._group_alive():
                return
            time.sleep(_TICK)
        say(f"the command did not stop within {kill_after:g}s of SIGTERM: killing it")
        self._kill_group()

    def _kill_group(self) -> None:
        child = self._child
        if child is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=10)
        deadline = time.monotonic() + 10
        while self._group_alive() and time.monotonic() < deadline:
            _reap_orphans()
            time.sleep(_TICK)


def _exit_status(returncode: int) -> int:
    # A command killed by a signal exits 128 + N, as a shell reports it.
    return 128 - returncode if returncode < 0 else returncode


def _reap_orphans() -> None:
    """Reap children we were left with (as PID 1 in a container, orphans are ours to reap)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _give_terminal(pgid: int) -> int | None:
    """Make the command's process group the terminal's foreground one, as a shell would.

    Ctrl-C then reaches the command once, from the terminal, and the command
    may read the terminal. Returns the terminal's descriptor, if there is one.
    """
    try:
        fd = sys.stdin.fileno() if sys.stdin is not None else 0
        if not os.isatty(fd) or os.tcgetpgrp(fd) != os.getpgrp():
            return None
        _with_sigttou_ignored(lambda: os.tcsetpgrp(fd, pgid))
    except (OSError, ValueError):
        return None
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGCONT)  # in case it read the terminal before it was its own
    return fd


def _take_terminal_back(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            _with_sigttou_ignored(lambda: os.tcsetpgrp(fd, os.getpgrp()))


def _with_sigttou_ignored(action: Callable[[], None]) -> None:
    # A process not in the foreground that sets the foreground group gets SIGTTOU.
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        action()
    finally:
        signal.signal(signal.SIGTTOU, previous)
