"""What a call that lets go of the GIL costs a busy daemon: formats/policy.py's checkpoint_hash, two ways.

`python -m bench.probes.gil_release` times the fingerprint of a small policy's
variables.index (800 bytes) by TensorFlow's Fingerprint op (eager) and by
pyfarmhash's fingerprint64 (the same farmhash Fingerprint64), first alone,
then beside one thread running Python. A call that drops the GIL (as the
eager op does) waits on return for the busy thread to give it back; one
that keeps it does not. The daemon's save path has dozens of busy threads,
so such a wait is paid per save, on the save's own latency.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _per_call(call: Callable[[], object], n: int) -> tuple[float, float]:
    """(wall, this thread's CPU) milliseconds per call, over `n` calls."""
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(n):
        call()
    return (time.perf_counter() - wall) / n * 1e3, (time.thread_time() - cpu) / n * 1e3


def main() -> None:
    import farmhash
    import tensorflow as tf

    index = os.urandom(800)
    method = tf.constant("farmhash64")
    calls = {
        "TensorFlow's Fingerprint op": lambda: tf.raw_ops.Fingerprint(data=tf.constant([index]), method=method).numpy(),
        "pyfarmhash fingerprint64": lambda: farmhash.fingerprint64(index),
    }
    for call in calls.values():
        call()  # warm: the op's first run builds its kernel
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    for busy in (False, True):
        spinner = threading.Thread(target=spin, daemon=True)
        if busy:
            spinner.start()
        for name, call in calls.items():
            wall, cpu = _per_call(call, 200)
            print(f"{'beside a busy thread' if busy else 'alone':>20}  {name:<28} wall {wall:.3f} ms, CPU {cpu:.3f} ms")
    stop.set()


if __name__ == "__main__":
    main()
