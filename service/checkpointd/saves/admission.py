"""What a registration or a save request must pass before the lane decides: names, kinds and dirs.

Each check raises the error the caller hears (nothing is counted or
written yet); `checkpointd.saves.pipeline` asks them in order.
"""

from __future__ import annotations

from checkpointd.core.ports import Store
from checkpointd.protocol.errors import AlreadyExistsError, InvalidRequestError, RunNotFoundError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.names import check_export_dir, check_run_name
from checkpointd.saves.checkpoint_dirs import directory_of


def check_folder(folder: str) -> str:
    """A run folder's name: the rules of run names, said for folders."""
    try:
        return check_run_name(folder)
    except InvalidRequestError:
        raise InvalidRequestError(
            f"folder {folder!r} is invalid: like a run name, use 1-128 characters of "
            "A-Z a-z 0-9 . _ -, starting with a letter or digit"
        ) from None


def claimed_dir(run: str, kind: SaveKind | None, checkpoint_dir: str | None) -> str | None:
    """The checkpoint dir a registration claims, checked: a training run's, normalized; None: no claim.

    Raises:
        InvalidRequestError: a policy run names a dir, or the dir is not a valid export dir.
    """
    if checkpoint_dir is None:
        return None
    if kind is not SaveKind.TRAINING_CHECKPOINT:
        raise InvalidRequestError(
            f"run {run!r}: checkpoint_dir is for training checkpoint runs; a policy run names its dirs per save"
        )
    try:
        return check_export_dir(checkpoint_dir).as_posix()
    except InvalidRequestError as e:
        raise InvalidRequestError(f"run {run!r}: checkpoint_dir {checkpoint_dir!r}: {e}") from None


def check_kind(run: str, kinds: tuple[SaveKind, ...], kind: SaveKind) -> None:
    """Raises InvalidRequestError unless `kind` is one of the saves `run` was registered for."""
    if kind not in kinds:
        raise InvalidRequestError(
            f"run {run!r} was registered for {', '.join(k.value for k in kinds)} saves, not "
            f"{kind.value}; register a run of its own for them"
        )


def check_claimed_dir(run: str, claim: str | None, export_dir: str) -> None:
    """Raises InvalidRequestError if a training run that claims dir `claim` saves into another dir."""
    if claim is not None and directory_of(export_dir) != claim:
        raise InvalidRequestError(
            f"run {run!r} writes checkpoint dir {claim!r}, not {directory_of(export_dir)!r} "
            f"(export_dir {export_dir!r}): register a run of its own for another dir"
        )


def refuse_replacing_another_runs(store: Store, run: str, folder: str, export_dir: str) -> None:
    """Raises AlreadyExistsError if another run committed the training checkpoint at `export_dir`.

    A run that takes over a dir (a renamed job) resumes from its newest
    checkpoint, so its steps go on from there; a save at a step another
    stream already committed would replace that stream's checkpoint. The
    same run saving a step again (a trainer restarted after a crash) may.
    """
    try:
        there = store.committed_at(folder, export_dir)
    except RunNotFoundError:
        return
    if there.run != run:
        directory = directory_of(export_dir)
        raise AlreadyExistsError(
            f"{export_dir!r} in folder {folder!r} is a checkpoint run {there.run!r} committed (step "
            f"{there.step}); run {run!r} does not replace another stream's checkpoint. Restore the "
            f"dir's newest checkpoint first (RemoteCheckpointer restores it at construction: call "
            f"initialize_or_restore() and save from its step on), or give this checkpointer another "
            f"ckpt_dir than {directory!r}"
        )
