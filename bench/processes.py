"""Worker processes: ``python -m bench.worker MODE CONFIG``, spoken to in JSON lines.

A worker reads commands on stdin and answers on stdout, one JSON object per
line; its stderr goes to a file whose tail is shown if it fails. Windows of
measurement are given as instants on `time.monotonic`, which every process
of the machine shares, so several workers start and stop together.
Every wait has a deadline, and workers still running at the end are killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

START_TIMEOUT = 30.0


class WorkerFailed(RuntimeError):
    pass


class Worker:
    """One worker process and its line channel."""

    def __init__(self, mode: str, config: dict[str, Any], python: str | None = None) -> None:
        """Start ``python -m bench.worker MODE CONFIG`` under ``python`` (default: this interpreter)."""
        self.mode = mode
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [python or sys.executable, "-m", "bench.worker", mode, json.dumps(config)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"bench-{mode}-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, **message: Any) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise WorkerFailed(f"{self.mode} worker {self.pid} is gone: {self.stderr_tail()}") from None

    def receive(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise WorkerFailed(f"{self.mode} worker {self.pid} said nothing for {timeout:g}s") from None
        if line is None:
            self.proc.wait(5)
            raise WorkerFailed(f"{self.mode} worker {self.pid} exited ({self.proc.returncode}): {self.stderr_tail()}")
        message: dict[str, Any] = json.loads(line)
        if "error" in message:
            raise WorkerFailed(f"{self.mode} worker {self.pid}: {message['error']}")
        return message

    def stderr_tail(self, size: int = 3000) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-size:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.send(cmd="quit")
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self._stderr.close()


@contextlib.contextmanager
def workers(mode: str, configs: list[dict[str, Any]], python: str | None = None) -> Iterator[list[Worker]]:
    """Start one worker per config and wait until each says it is ready; stop them all at the end."""
    started: list[Worker] = []
    try:
        for config in configs:
            started.append(Worker(mode, config, python))
        for worker in started:
            worker.receive(START_TIMEOUT)  # {"ready": ...}
        yield started
    finally:
        for worker in started:
            worker.stop()


def run_window(started: list[Worker], seconds: float, *, lead: float = 0.2) -> list[dict[str, Any]]:
    """Have every worker run its loop over the same window on `time.monotonic`; their reports."""
    start = time.monotonic() + lead
    for worker in started:
        worker.send(cmd="go", start=start, end=start + seconds)
    return [worker.receive(lead + seconds + 30.0) for worker in started]
