"""A RemoteCheckpointer's save on notice: the step reached, saved and durable within the notice's deadline.

`checkpointd_client.notice` says where and when it is taken (at a safe point
of the main thread, never inside this client's own calls) and calls
`_save_on_notice`; this is what the checkpointer does then. `SavesOnNotice`
is a base of `RemoteCheckpointer`, which holds the state named below.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from checkpointd_client import training_saves
from checkpointd_client.continuous import ContinuousSaves
from checkpointd_client.notice import Notice, NoticeOutcome
from checkpointd_client.ticket import SaveTicket
from checkpointd_client.transport.session import time_left


class SavesOnNotice:
    """The save on notice of `RemoteCheckpointer` (`checkpointd_client.notice` calls it)."""

    # RemoteCheckpointer's, set in its constructor.
    _run: str
    _notice_deadline: float
    _continuous: ContinuousSaves | None
    _step: tf.Variable | None
    _saves: training_saves.TrainingSaves
    _last_ticket: SaveTicket | None

    if TYPE_CHECKING:

        def _save(self, global_step: Any, blocking: bool, on_notice: Notice | None = None) -> SaveTicket: ...

    def _save_on_notice(self, on_notice: Notice) -> NoticeOutcome:
        """Saves the step reached as a save on notice and waits until it is durable, by the deadline; never raises.

        A save of that step already made by this checkpointer (in flight, or
        durable) is waited for instead of sending another.
        """
        deadline = on_notice.monotonic + self._notice_deadline
        step: int | None = None
        # The last continuous call not saved: saved now (its step, if no object names one).
        pending = self._continuous.take_pending() if self._continuous is not None else None
        try:
            # Eager even inside a tf.function's trace, and unseen by a gradient tape.
            with tf.init_scope():
                if self._step is None and pending is None:
                    return NoticeOutcome(
                        self._run, None, False,
                        lost="none of its objects is a step (global_step, train_step, step, or an agent's "
                        f"train_step_counter), which names a checkpoint; {self._saves.lost(None)}",
                    )  # fmt: skip
                step = int(self._step.numpy() if self._step is not None else np.asarray(pending))
                last = self._last_ticket
                if last is not None and last.step == step and not last.skipped:
                    training_saves.wait_unlocked(last, deadline)
                    if last._error is None:  # noqa: SLF001 - read once ended, without the ticket's lock
                        return self._durable(step, on_notice)
                    # That one failed: the save on notice sends its own.
                ticket = self._save(step, True, on_notice)
                ticket.result(time_left(deadline))
        except Exception as e:  # noqa: BLE001 - the outcome reports it
            return NoticeOutcome(self._run, step, False, lost=f"{type(e).__name__}: {e}; {self._saves.lost(step)}")
        return self._durable(step, on_notice)

    def _durable(self, step: int, on_notice: Notice) -> NoticeOutcome:
        return NoticeOutcome(self._run, step, True, durable_ms=(time.monotonic() - on_notice.monotonic) * 1000)
