"""A trace function that raises where a signal handler could: the interrupt tests' stand-in for a signal.

CPython runs a signal handler where the interpreter checks for pending work: as a function starts
or a generator resumes, after a call returns (a lock taken, a reply read), at a loop's back edge.
`RaiseAtCheck` raises at the ``at``-th of those it meets in the frames of the files it watches, on
the thread it is installed on (``sys.settrace``); with ``at=0`` it only counts them (``seen``).
"""

from __future__ import annotations

import dis
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any


class RaiseAtCheck:
    """Raises ``error`` at the ``at``-th point where a signal handler could run, in the frames ``watched`` picks."""

    def __init__(self, at: int, error: type[BaseException], watched: Callable[[str], bool]) -> None:
        self.at = at
        self.error = error
        self.watched = watched
        self.seen = 0
        self.where = ""
        self._last: dict[int, str] = {}

    def __call__(self, frame: FrameType, event: str, arg: object) -> Any:
        if not self.watched(frame.f_code.co_filename):
            return None
        frame.f_trace_opcodes = True
        self._check(frame)  # a function starting, or a generator resuming
        return self._opcode

    def _opcode(self, frame: FrameType, event: str, arg: object) -> Any:
        if event == "exception":
            # A call that raised did not return: the interpreter unwinds to the frame's `except` or
            # `finally` without looking for pending signals, so no signal handler runs at its first
            # instruction. Nor may the trace raise there: CPython (3.11, 3.13) would then take the
            # exception being caught for the one handled before it, and leave it as the thread's
            # handled exception for good (every later `raise` in the thread carrying it as its
            # __context__).
            self._last[id(frame)] = event
        elif event == "opcode":
            op = dis.opname[frame.f_code.co_code[frame.f_lasti]]
            after = self._last.get(id(frame), "")
            self._last[id(frame)] = op
            if after.startswith("CALL") or op == "JUMP_BACKWARD":
                self._check(frame)
        return self._opcode

    def _check(self, frame: FrameType) -> None:
        self.seen += 1
        if self.seen == self.at:
            self.where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} ({frame.f_code.co_name})"
            raise self.error(f"raised at {self.where}")


class RunAtCheck(RaiseAtCheck):
    """Runs ``handler`` at the ``at``-th point where a signal handler could run: a signal handler that
    returns (one calling ``stop()``, say), where `RaiseAtCheck` stands for one that raises."""

    def __init__(self, at: int, handler: Callable[[], object], watched: Callable[[str], bool]) -> None:
        super().__init__(at, RuntimeError, watched)
        self.handler = handler

    def _check(self, frame: FrameType) -> None:
        self.seen += 1
        if self.seen == self.at:
            self.where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} ({frame.f_code.co_name})"
            self.handler()
