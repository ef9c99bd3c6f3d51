"""The demo's processes: daemons and trainers it starts, watches and stops.

Every child is started in a session of its own, so a Ctrl-C on the terminal
reaches the demo alone, which then stops the children in order (trainers
killed, daemons sent SIGTERM so accepted saves finish, the S3 server last).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

TRAINER = Path(__file__).resolve().parent / "trainer.py"


class DemoError(Exception):
    """Something the demo started did not do what it should; the message says where to look."""


def shown(path: Path) -> str:
    """`path` relative to the working dir when it is under it (shorter to read), else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


@dataclass
class Daemon:
    """A `checkpointd serve` subprocess: its gRPC address, metrics URL and log."""

    name: str
    proc: subprocess.Popen[bytes]
    address: str
    metrics_url: str
    log: Path

    def stop(self) -> int | None:
        """SIGTERM (accepted saves finish), then SIGKILL after 60 s; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def kill(self) -> None:
        """SIGKILL: the node is gone."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def start_daemon(name: str, serve_args: Sequence[str], work: Path, env: dict[str, str] | None = None) -> Daemon:
    """Starts `checkpointd serve` on ports of its choosing and waits until it reports them."""
    work.mkdir(parents=True, exist_ok=True)
    port_file, metrics_file, log = work / "port", work / "metrics-port", work / "daemon.log"
    for f in (port_file, metrics_file):
        f.unlink(missing_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "checkpointd", "serve", *serve_args, "--port", "0", "--port-file", str(port_file)]
            + ["--metrics-port", "0", "--metrics-port-file", str(metrics_file)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    deadline = time.monotonic() + 90
    while not (port_file.exists() and metrics_file.exists()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise DemoError(f"checkpointd {name} did not start; see {log}")
        time.sleep(0.1)
    port, metrics_port = port_file.read_text().strip(), metrics_file.read_text().strip()
    return Daemon(name, proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", log)


def scrape(metrics_url: str) -> dict[str, float]:
    """The daemon's own counters from its /metrics, summed over runs and kinds.

    Returns:
        accepted (saves the daemon took: written, failed or still in flight),
        skipped, written, failed, written_bytes, of the saves on notice
        notice_ok, notice_failed, notice_cancelled, and of the ended trainers'
        standby snapshots standby_written, standby_not_newer, ... (one per outcome).
    """
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    totals = {"written": 0.0, "skipped": 0.0, "failed": 0.0, "in_flight": 0.0, "written_bytes": 0.0}
    totals.update(notice_ok=0.0, notice_failed=0.0, notice_cancelled=0.0, standby_written=0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "checkpointd_saves_total":
                outcome = {"ok": "written"}.get(sample.labels.get("outcome", ""), sample.labels.get("outcome", ""))
                if outcome in totals:
                    totals[outcome] += sample.value
            elif sample.name == "checkpointd_saves_in_flight":
                totals["in_flight"] += sample.value
            elif sample.name == "checkpointd_written_bytes_total":
                totals["written_bytes"] += sample.value
            elif sample.name == "checkpointd_preemption_saves_total":
                totals["notice_" + sample.labels.get("outcome", "")] = sample.value
            elif sample.name == "checkpointd_standby_saves_total":
                totals["standby_" + sample.labels.get("outcome", "")] = sample.value
    totals["accepted"] = totals["written"] + totals["failed"] + totals["in_flight"]
    return totals


@dataclass
class Trainer:
    """A trainer subprocess (trainer.py) and what it has said on stdout so far."""

    proc: subprocess.Popen[str]
    log: Path
    log_start: int = 0  # where this trainer's lines begin in `log` (appended to by every demo run)
    step: int = 0
    saved: list[int] = field(default_factory=list)
    at: dict[int, float] = field(default_factory=dict)  # each step it reached, and when (seconds since it started)
    _lines: queue.Queue[str | None] = field(default_factory=queue.Queue)

    @classmethod
    def start(cls, args: Sequence[str], log: Path) -> Trainer:
        log.parent.mkdir(parents=True, exist_ok=True)
        log_start = log.stat().st_size if log.exists() else 0
        with open(log, "a") as err:
            proc = subprocess.Popen(
                [sys.executable, str(TRAINER), *args],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )
        trainer = cls(proc, log, log_start)
        threading.Thread(target=trainer._read, args=(proc.stdout,), daemon=True).start()
        return trainer

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            if line.startswith("@"):
                self._lines.put(line[1:].strip())
        self._lines.put(None)

    def wait_for(self, kind: str, until: Callable[[Trainer], bool] = lambda t: True, seconds: float = 600) -> list[str]:
        """Reads the trainer's lines until one of `kind` after which `until(self)` holds; returns its fields."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise DemoError(f"the trainer said no '{kind}' in {seconds:.0f} s; see {self.log}") from None
            if line is None:
                code = self.proc.wait()
                raise DemoError(f"the trainer exited ({code}) before '{kind}'; see {self.log}")
            fields = line.split()
            self._note(fields)
            if fields[0] == kind and until(self):
                return fields[1:]

    def _note(self, fields: list[str]) -> None:
        """Keeps what one line says of the trainer's progress."""
        if fields[0] == "step":
            self.step = int(fields[1])
            self.at[self.step] = float(fields[2])
        elif fields[0] == "saved" and fields[2] == "accepted":
            self.saved.append(int(fields[1]))
        elif fields[0] == "restored":  # the step it restored, when its training began
            self.at[int(fields[1])] = float(fields[3])

    def seconds_between(self, first: int, last: int) -> float | None:
        """The seconds this trainer took from step `first` to step `last` (None: it did not say both)."""
        start, end = self.at.get(first), self.at.get(last)
        return None if start is None or end is None else end - start

    def notice(self, seconds: float = 60) -> int:
        """SIGTERM, as a preemption announced (Kubernetes, a spot VM) sends; waits until the trainer exits.

        Reads what the trainer said until then (`step` is its last step line).

        Returns:
            Its exit code (-15: ended by the SIGTERM, as a process without a handler is).

        Raises:
            DemoError: it did not exit within `seconds`.
        """
        os.kill(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + seconds
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise DemoError(f"the trainer did not exit {seconds:.0f} s after SIGTERM; see {self.log}") from None
            if line is None:
                return self.proc.wait()
            self._note(line.split())

    def logged(self, pattern: str) -> re.Match[str] | None:
        """The first match of `pattern` in what this trainer wrote to its log (stderr)."""
        with open(self.log, errors="replace") as log:
            log.seek(self.log_start)
            return re.search(pattern, log.read(), re.MULTILINE)

    def kill(self) -> None:
        """SIGKILL, as a preemption without notice does: no cleanup in the trainer."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def read_to_end(self, seconds: float = 10) -> None:
        """After the trainer ended: reads what it said before it ended, so `step` is the last step it reached."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return  # its output was not closed (a child of it holds the pipe): what was read stands
            if line is None:
                return
            self._note(line.split())
