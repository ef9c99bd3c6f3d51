"""A run's registration: checked, its lease taken, its template stored, its lane opened; without gRPC.

`SavePipeline.register` (`checkpointd.saves.pipeline`) calls `register`
with the pipeline's config, formats, lanes and leases. Bad input is refused
before the lease is taken; the lease is taken before anything of the run is
stored (waiting for another daemon's within the call's deadline).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from checkpointd.core.config import ServeConfig
from checkpointd.core.ports import Leases
from checkpointd.core.variable_manifest import Manifest, VariableSpec
from checkpointd.protocol.errors import LimitExceededError, SaveFailedError, describe
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.names import check_run_name
from checkpointd.saves import admission
from checkpointd.saves.kinds import Formats
from checkpointd.saves.runs import Lanes
from checkpointd.saves.skip_log import SkipLog

_LOGGER = logging.getLogger("checkpointd.saves.pipeline")  # the pipeline's log lines, as operators grep them


def register(
    config: ServeConfig,
    formats: Formats,
    lanes: Lanes,
    leases: Leases,
    skips: SkipLog,
    run_kinds: dict[str, tuple[SaveKind, ...]],
    run: str,
    folder: str,
    variables: Sequence[VariableSpec],
    checkpoint_object_graph: bytes,
    template_bytes: int,
    receive_template: Callable[[], Path],
    kind: SaveKind | None = None,
    timeout: float | None = None,
    on_lease_wait: Callable[[str], None] | None = None,
    checkpoint_dir: str | None = None,
) -> Manifest:
    """Registers (or re-registers) a run from its uploaded policy template.

    Args:
        run: the run's name (checked).
        folder: where its saves land under the root; "" for the run's name.
        variables: every snapshot's variables, in snapshot order.
        checkpoint_object_graph: `PolicySaver.save_checkpoint`'s object graph.
        template_bytes: the template's announced size.
        receive_template: reads the uploaded files into a staging dir it
            returns (deleted afterwards).
        kind: the family of saves the run makes: None, SAVED_MODEL or
            CHECKPOINT for a policy run (with a template),
            TRAINING_CHECKPOINT for a training run (with nothing).
        timeout: seconds left of the call (None: no deadline): how long
            it may wait for another daemon's lease on the run, less a
            reserve so the refusal arrives before the caller gives up;
            at most `ServeConfig.register_wait_seconds`.
        on_lease_wait: called once, with a sentence for people, before it
            waits for another daemon's lease (the servicer sends it on).
        checkpoint_dir: a training run's checkpoint dir in `folder`,
            which it alone writes while open; None: no claim.

    Raises:
        InvalidRequestError, LimitExceededError: the request is refused;
            nothing is registered.
        RunHeldError: another daemon still holds the run's lease.
        UnavailableError: the store holding the leases cannot be reached,
            or the daemon is draining (on notice, it takes only the runs
            registered on it).
        SaveFailedError: the template could not be stored (the OS's reason).
    """
    run = check_run_name(run)
    folder = admission.check_folder(folder) if folder else run
    claim = admission.claimed_dir(run, kind, checkpoint_dir)
    # A policy run's template goes to the format of policy saves; a
    # training run's (empty) registration to the training format.
    fmt = formats(kind or SaveKind.SAVED_MODEL)
    # Before its lease or template: a daemon on notice takes no new run, and another
    # stream of the same name or dir is refused (the open run's template stays as it was).
    lanes.check_registration(run, folder, claim, tuple(fmt.kinds))
    if template_bytes > config.max_template_bytes:
        raise LimitExceededError(
            f"template of {template_bytes} bytes exceeds the daemon's limit of "
            f"{config.max_template_bytes} (--max-template-bytes)"
        )
    started = time.monotonic()
    with lanes.registering(run, folder):  # a takeover's retention, as the lease is taken, needs the folder
        leases.hold(
            run, started + _lease_wait(config, timeout), waiting=on_lease_wait
        )  # before anything of the run is stored
    try:
        manifest = fmt.register(run, receive_template(), variables, checkpoint_object_graph)
    except OSError as e:  # the state dir: unwritable, full, gone (logged as the call ends)
        raise SaveFailedError(f"run {run!r}: could not store its template: {describe(e)}") from e
    lanes.register(run, manifest, folder, claim, tuple(fmt.kinds))
    skips.forget(run)  # a restarted trainer's first skip is logged as a first again
    run_kinds[run] = tuple(fmt.kinds)
    _LOGGER.info(
        "registered run=%s folder=%s variables=%d snapshot_bytes=%d template_bytes=%d in %.3fs",
        run, folder, len(manifest.variables), manifest.nbytes, template_bytes,
        time.monotonic() - started,
    )  # fmt: skip
    return manifest


def _lease_wait(config: ServeConfig, timeout: float | None) -> float:
    wait = config.register_wait_seconds
    # gRPC reports a call without a deadline as ~292 years left.
    if timeout is not None and timeout < threading.TIMEOUT_MAX:
        wait = min(wait, max(0.0, timeout - min(1.0, 0.2 * timeout)))
    return wait
