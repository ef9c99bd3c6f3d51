"""Running a command with its stderr on a pseudo-terminal, as a person's shell would."""

from __future__ import annotations

import os
import select
import subprocess
import time
from collections.abc import Mapping, Sequence


def stderr_on_a_terminal(
    command: Sequence[str], timeout: float, env: Mapping[str, str] | None = None
) -> tuple[int, str, str]:
    """Runs `command` with stderr on a pseudo-terminal and stdout on a pipe.

    Returns:
        Its exit code, its stdout, and what the terminal showed.

    Raises:
        subprocess.TimeoutExpired: the command ran (or kept the terminal open)
            past `timeout` seconds; it is killed first.
    """
    deadline = time.monotonic() + timeout
    controller, terminal = os.openpty()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=terminal, env=env, text=True)
    try:
        os.close(terminal)
        terminal = -1
        shown = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(list(command), timeout)
            readable, _, _ = select.select([controller], [], [], left)
            if not readable:
                continue
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not chunk:
                break
            shown += chunk
        out, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
        return proc.returncode, out, shown.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        os.close(controller)
        if terminal >= 0:
            os.close(terminal)
