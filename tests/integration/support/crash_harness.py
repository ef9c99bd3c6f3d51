"""Crash consistency: SIGKILL the daemon during saves, restart it, check every save.

Each trial starts the real daemon (`checkpointd serve`) on the same root,
registers a run through `RemotePolicySaver`, saves back to back into a small
pool of export dirs (SavedModels and checkpoints, blocking and not, so most
saves replace an earlier one) and kills the daemon with SIGKILL at a random
moment while saves run. The next trial's restart must leave the root
consistent; after it (its `local.recover` has run once the port file exists):

- no `.checkpointd-tmp-*` or `.checkpointd-old-*` dir is left anywhere, and
  no registration staging dir;
- every export dir is absent only if it was never durable: a dir once reported
  durable, or seen complete after a restart, is never lost, and never goes
  back to an older step;
- every export dir verifies against its `checkpointd.manifest.json`, holds a
  step that was sent to it, and loads: `tf.saved_model.load` (its train step
  is the manifest's) for SavedModels, `tf.train.load_checkpoint` reading every
  key for checkpoints;
- the unrelated entries planted under the root survive.

The kill's moment is classified from the frozen disk state and the trainer's
view: `stream` (the save's temp dir holds its variables' data file, being
written as the chunks arrive, and no index yet), `write` (the save's temp dir
exists otherwise: opening, finishing, committing), `replace` (the replaced tree is
parked), `published` (the new tree is in place, its reply not yet received),
`upload` (a save was asked or accepted and nothing of it is on disk yet),
`idle` (between two saves), and `batched` (a small save's files and manifest
are written in its temp dir and the group commit's shared sync, which makes
them durable before the rename, has not returned). The daemon runs under
`tests.integration.support.slow_sync`, which widens each shared sync by SYNC_DELAY,
so a kill can land between the batched writes and the sync, and between the
rename and the second sync (`published`). Of the trials, a third kill at a
point inside the streamed write (as soon as a save's data file is being
written and its index is not), a third inside the group commit (as soon as
a temp dir holds its manifest, or, in half of those, as soon as the new tree
is in place before its reply), the rest at a random moment.

Long mode (the pytest test runs a short subset; CHECKPOINTD_CRASH_TRIALS
changes its count):

    python -m tests.integration.support.crash_harness --trials 100 --sizes small,medium
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from checkpointd import durable  # noqa: E402
from checkpointd.cli import verify
from checkpointd.protocol.errors import CheckpointdError  # noqa: E402
from checkpointd.storage import (
    local,
    save_manifest,  # noqa: E402
)
from checkpointd.transport import shm
from checkpointd.transport.shm import default_shm_root  # noqa: E402
from checkpointd_client import RemotePolicySaver  # noqa: E402
from tests.integration.support import policies  # noqa: E402
from tests.integration.support.daemon import Daemon, start_daemon  # noqa: E402

# Hidden layers of the QNetwork: ~400 parameters, and ~2.4M (9.5 MB a snapshot).
SIZES = {"small": (16,), "medium": (1536, 1536)}
# Export dirs each run saves into, with the kind each always holds.
POOL = (
    ("sm-a", "saved_model"),
    ("sm-b", "saved_model"),
    ("nested/sm-c", "saved_model"),
    ("ck-a", "checkpoint"),
    ("ck-b", "checkpoint"),
)
PHASES = ("upload", "stream", "write", "batched", "replace", "published", "idle")
_TRAIN_STEP_KEY = "train_step/.ATTRIBUTES/VARIABLE_VALUE"
_DEADLINE = 120.0  # for any one wait in a trial: a registration, a save, a join
SYNC_DELAY = 0.05  # seconds each group commit's shared sync waits first (tests.integration.support.slow_sync)
SLOW_SYNC = (sys.executable, "-m", "tests.integration.support.slow_sync", str(SYNC_DELAY), "--")


@dataclass
class Figures:
    """What the trials did and found."""

    trials: int = 0
    kills: collections.Counter[str] = field(default_factory=collections.Counter)
    kills_by_size: collections.Counter[str] = field(default_factory=collections.Counter)
    saves_durable: int = 0
    saves_cut: int = 0  # in a save call when the daemon died
    dirs_verified: int = 0
    loads: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        kills = ", ".join(f"{p} {self.kills[p]}" for p in PHASES)
        sizes = ", ".join(f"{s} {n}" for s, n in sorted(self.kills_by_size.items()))
        return (
            f"{self.trials} trials ({sizes}) in {self.seconds:.1f}s; kills during: {kills}; "
            f"{self.saves_durable} saves durable, {self.saves_cut} cut by a kill; "
            f"{self.dirs_verified} dir checks against manifests, {self.loads} loads; "
            f"{len(self.failures)} failures"
        )


@dataclass
class _Run:
    """One run's policy and what the trainer knows of its export dirs."""

    name: str
    size: str
    policy: object
    train_step: tf.Variable
    sent: dict[str, set[int]] = field(default_factory=lambda: collections.defaultdict(set))
    # The oldest step each dir may hold from now on: the last one reported
    # durable or seen complete after a restart. A dir in here must exist.
    floor: dict[str, int] = field(default_factory=dict)
    # (step, created) of each dir when last loaded: only changed dirs are loaded again.
    loaded: dict[str, tuple[int, float]] = field(default_factory=dict)


class _Driver(threading.Thread):
    """The trainer: saves back to back until a save fails (the daemon died)."""

    def __init__(self, saver: RemotePolicySaver, run: _Run, steps: Callable[[], int], seed: int) -> None:
        super().__init__(name=f"driver-{run.name}", daemon=True)
        self._saver, self._run, self._steps = saver, run, steps
        self._rng = random.Random(seed)
        self.lock = threading.Lock()
        self._progress = threading.Condition(self.lock)  # notified per durable save and at the end
        self._ended = False
        self.pending: tuple[str, int] | None = None  # (dir, step) of the save call running
        self.started = threading.Event()
        self.killed = threading.Event()  # set just before the SIGKILL
        self.durable = 0
        self.cut = 0
        self.cycle: list[float] = []  # seconds per completed save
        self.error: BaseException | None = None

    def wait_saves(self, count: int, timeout: float) -> bool:
        """Waits until `count` saves are durable; False if the driver ended first or time ran out."""
        with self._progress:
            self._progress.wait_for(lambda: self.durable >= count or self._ended, timeout)
            return self.durable >= count

    def run(self) -> None:
        try:
            self._save_until_it_fails()
        finally:
            with self._progress:
                self._ended = True
                self._progress.notify_all()

    def _save_until_it_fails(self) -> None:
        while True:
            export_dir, kind = self._rng.choice(POOL)
            step = self._steps()
            self._run.train_step.assign(step)
            with self.lock:
                self.pending = (export_dir, step)
                self._run.sent[export_dir].add(step)
            self.started.set()
            began = time.monotonic()
            try:
                save = self._saver.save if kind == "saved_model" else self._saver.save_checkpoint
                ticket = save(export_dir, blocking=self._rng.random() < 0.3)
                if ticket.skipped:  # cannot happen with one save at a time; fail loudly
                    raise AssertionError(f"save to {export_dir} skipped: {ticket.reason}")
                ticket.result(_DEADLINE)
            except CheckpointdError as exc:
                if not self.killed.is_set():  # a save failed on a live daemon: a finding
                    self.error = exc
                    return
                with self.lock:
                    self.cut += 1
                return
            except BaseException as exc:  # noqa: BLE001 - reported by the trial
                self.error = exc
                return
            with self._progress:
                self.pending = None
                self.durable += 1
                self._run.floor[export_dir] = step
                self.cycle.append(time.monotonic() - began)
                self._progress.notify_all()


def _plant(root: Path, run: str) -> dict[Path, str]:
    """Entries recover() must leave alone, with their contents."""
    outside = root.parent / f"{root.name}-outside"
    planted = {
        root / "unrelated" / "keep.txt": "unrelated dir",
        root / run / "my-tmp-dir" / "keep.txt": "user dir",
        root / run / ".checkpointd-old-notours-zz" / "keep.txt": "not our hex suffix",
        root / run / ".checkpointd-tmp" / "keep.txt": "no dash: not our prefix",
        outside / f"{local.TMP_PREFIX}x-0123456789abcdef" / "keep.txt": "behind a symlink",
    }
    for path, text in planted.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    link = root / run / "link-outside"
    if not link.is_symlink():
        link.symlink_to(outside, target_is_directory=True)
    return planted


def _leftovers(root: Path) -> list[Path]:
    """Temp and parked dirs of the daemon under `root` (symlinks not followed)."""
    found = []
    for dirpath, dirnames, _ in os.walk(root):
        for name in dirnames:
            if name.startswith(local.TMP_PREFIX) or durable.files._split_old(name) is not None:  # noqa: SLF001
                found.append(Path(dirpath, name))
    staging = root / ".checkpointd" / "staging"
    if staging.is_dir():
        found.extend(staging.iterdir())
    return found


def _load(save_dir: Path, kind: str, step: int) -> str | None:
    """Loads a save with TensorFlow; returns a problem or None."""
    try:
        if kind == "saved_model":
            loaded = tf.saved_model.load(str(save_dir))
            got = int(loaded.get_train_step())
        else:
            reader = tf.train.load_checkpoint(str(save_dir / "variables" / "variables"))
            for key in reader.get_variable_to_shape_map():
                reader.get_tensor(key)
            got = int(reader.get_tensor(_TRAIN_STEP_KEY))
    except Exception as exc:  # noqa: BLE001 - any load error is the finding
        return f"{save_dir}: does not load: {type(exc).__name__}: {exc}"
    if got != step:
        return f"{save_dir}: holds train step {got}, its manifest says {step}"
    return None


def _check_dirs(root: Path, runs: Sequence[_Run], figures: Figures) -> list[str]:
    """Every export dir: verified, a step sent to it, not older than its floor, loadable."""
    problems = []
    for run in runs:
        run_dir = root / run.name
        for report in verify.verify_paths([run_dir]) if run_dir.is_dir() else []:
            figures.dirs_verified += report.ok
            if not report.ok and "no save dirs" not in report.reason:
                problems.append(f"verify {report.path}: {report.reason}")
        for export_dir, kind in POOL:
            path = run_dir / export_dir
            if not path.exists():
                if export_dir in run.floor:
                    problems.append(f"{path}: lost (it held step {run.floor[export_dir]})")
                continue
            try:
                manifest = save_manifest.read_manifest(path)
            except save_manifest.ManifestError as exc:
                problems.append(f"{path}: {exc}")
                continue
            step, created = manifest["step"], manifest["created_unix_seconds"]
            if manifest["kind"] != kind or step not in run.sent[export_dir]:
                problems.append(f"{path}: a {manifest['kind']} of step {step}, never sent there")
            if step < run.floor.get(export_dir, step):
                problems.append(f"{path}: went back to step {step} from {run.floor[export_dir]}")
            run.floor[export_dir] = max(step, run.floor.get(export_dir, step))
            if run.loaded.get(export_dir) != (step, created):
                figures.loads += 1
                problem = _load(path, kind, step)
                if problem:
                    problems.append(problem)
                run.loaded[export_dir] = (step, created)
    return problems


def _streaming(run_dir: Path) -> bool:
    """Whether a save of the run is inside its streamed write: a temp dir with a data file and no index yet."""
    for tmp in _leftovers(run_dir):
        if tmp.name.startswith(local.TMP_PREFIX):
            try:
                names = os.listdir(tmp / "variables")
            except OSError:  # not made yet, or committed meanwhile
                continue
            if any(n.startswith("variables.data-") for n in names) and "variables.index" not in names:
                return True
    return False


def _batched(run_dir: Path) -> bool:
    """Whether a save of the run is in its group commit before the rename: a temp dir holding its manifest."""
    return any(
        tmp.name.startswith(local.TMP_PREFIX) and (tmp / save_manifest.MANIFEST_NAME).exists()
        for tmp in _leftovers(run_dir)
    )


def _published(root: Path, run: _Run, driver: _Driver) -> bool:
    """Whether the save in flight is in place (its manifest at the export dir) before its reply reached the trainer."""
    with driver.lock:
        pending = driver.pending
    if pending is None:
        return False
    try:
        return save_manifest.read_manifest(root / run.name / pending[0])["step"] == pending[1]
    except save_manifest.ManifestError:
        return False


def until(condition: Callable[[], bool], timeout: float) -> bool:
    """Polls `condition` (a kill point's trigger, so as often as the disk allows) until true or `timeout`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
    return False


def _classify(root: Path, run: _Run, pending: tuple[str, int] | None) -> str:
    """Which moment of a save the kill hit, from the frozen disk state."""
    parked = _leftovers(root / run.name)
    if any(p.name.startswith(local.TMP_PREFIX) for p in parked):
        if _streaming(root / run.name):
            return "stream"
        return "batched" if _batched(root / run.name) else "write"
    if parked:
        return "replace"
    if pending is None:
        return "idle"
    export_dir, step = pending
    try:
        if save_manifest.read_manifest(root / run.name / export_dir)["step"] == step:
            return "published"
    except save_manifest.ManifestError:
        pass
    return "upload"


def run_trials(
    trials: int,
    root: Path,
    workdir: Path,
    *,
    sizes: Sequence[str] = ("small",),
    seed: int = 0,
    log: Callable[[str], None] = lambda line: None,
) -> Figures:
    """Runs `trials` kill-and-restart trials on `root`; one last restart checks the last kill."""
    rng = random.Random(seed)
    figures = Figures()
    started = time.monotonic()
    runs = {}
    for size in sizes:
        policy = policies.build(policies.q(SIZES[size]))
        runs[size] = _Run(f"crash-{size}", size, policy, tf.Variable(0, dtype=tf.int64, name="train_step"))
    planted = {}
    for run in runs.values():
        planted.update(_plant(root, run.name))
    counter = iter(range(1, 1 << 62))
    cycle = {size: 0.2 for size in sizes}  # seconds per save, measured as trials go

    for trial in range(trials + 1):
        daemon = start_daemon(root, workdir, wrap=SLOW_SYNC)
        try:
            # The restart has run recover(); nothing else has touched the root yet.
            problems = [f"left after restart: {p}" for p in _leftovers(root)]
            problems += [
                f"planted {p} is gone or changed"
                for p, text in planted.items()
                if not (p.is_file() and p.read_text() == text)
            ]
            if trial == trials:  # the final check only
                problems += _check_dirs(root, list(runs.values()), figures)
                figures.failures += [f"after trial {trial}: {p}" for p in problems]
                break
            run = runs[sizes[trial % len(sizes)]]
            phase, driver = _trial(daemon, run, runs, figures, problems, lambda: next(counter), rng, cycle)
            figures.failures += [f"trial {trial} ({run.size}): {p}" for p in problems]
            figures.trials += 1
            figures.kills[phase] += 1
            figures.kills_by_size[run.size] += 1
            figures.saves_durable += driver.durable
            figures.saves_cut += driver.cut
            if driver.cycle:
                cycle[run.size] = sum(driver.cycle) / len(driver.cycle)
            log(
                f"trial {trial:3d} {run.size:6s}: killed during {phase:9s} after "
                f"{driver.durable} durable saves; {len(problems)} problems"
            )
        finally:
            if daemon.proc.poll() is None:
                daemon.proc.kill()
                daemon.proc.wait()
            shm_root = default_shm_root()
            if shm_root is not None:  # what the next daemon would clear of the killed ones
                shm.remove_dead_folders(shm_root)
    figures.seconds = time.monotonic() - started
    return figures


def _trial(
    daemon: Daemon,
    run: _Run,
    runs: dict[str, _Run],
    figures: Figures,
    problems: list[str],
    steps: Callable[[], int],
    rng: random.Random,
    cycle: dict[str, float],
) -> tuple[str, _Driver]:
    """Checks the root while registering, saves, kills; returns the kill's phase."""
    registered: list[RemotePolicySaver | BaseException] = []

    def register() -> None:
        try:
            saver = RemotePolicySaver(
                run.policy, daemon.address, run=run.name, train_step=run.train_step, timeout=_DEADLINE
            )
            saver.register()
            registered.append(saver)
        except BaseException as exc:  # noqa: BLE001 - reported below
            registered.append(exc)

    # Registering only writes the daemon's state dir, so the export dirs can
    # be checked (and loaded) meanwhile: the daemon imports TensorFlow then.
    registering = threading.Thread(target=register, name="register", daemon=True)
    registering.start()
    problems += _check_dirs(daemon.root, list(runs.values()), figures)
    registering.join(_DEADLINE)
    if not registered or isinstance(registered[0], BaseException):
        raise RuntimeError(f"registration failed: {registered[:1]}\n{daemon.log()[-3000:]}")
    saver = registered[0]
    driver = _Driver(saver, run, steps, rng.randrange(1 << 32))
    try:
        driver.start()
        if not driver.started.wait(_DEADLINE):
            raise RuntimeError("the driver never started a save")
        # The kill's moment: after 0, 1 or 2 durable saves (so there are dirs
        # to replace), then inside a streamed write or a group commit (the
        # kill points) or uniform over about one and a half saves.
        driver.wait_saves(rng.choice((0, 1, 2)), _DEADLINE)
        aim = rng.random()
        if aim < 1 / 3:
            until(lambda: _streaming(daemon.root / run.name), 3.0 * cycle[run.size] + 1.0)
        elif aim < 1 / 2:
            until(lambda: _batched(daemon.root / run.name), 3.0 * cycle[run.size] + 1.0)
        elif aim < 2 / 3:
            until(lambda: _published(daemon.root, run, driver), 3.0 * cycle[run.size] + 1.0)
        else:
            threading.Event().wait(rng.uniform(0.0, 1.5 * cycle[run.size]))
        driver.killed.set()
        os.kill(daemon.proc.pid, signal.SIGKILL)
        daemon.proc.wait(_DEADLINE)
        with driver.lock:
            pending = driver.pending
        phase = _classify(daemon.root, run, pending)
        driver.join(_DEADLINE)
        if driver.is_alive():
            problems.append("the trainer's save did not end after the daemon died")
        if driver.error is not None:
            problems.append(f"the trainer failed: {driver.error!r}")
    finally:
        saver._daemon._channel.close()  # noqa: SLF001 - close() would flush against a dead daemon
    return phase, driver


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=int(os.environ.get("CHECKPOINTD_CRASH_TRIALS", "100")))
    parser.add_argument("--sizes", default="small,medium", help="comma-separated: small, medium")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, help="daemon root (default: a temp dir, deleted if all is well)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    if not sizes or any(s not in SIZES for s in sizes) or args.trials < 1:
        parser.error(f"--sizes takes {', '.join(SIZES)}; --trials must be >= 1")
    # SIGTERM unwinds like Ctrl-C, so the running daemon is killed on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    base = Path(tempfile.mkdtemp(prefix="checkpointd-crash-"))
    root = args.root or base / "root"
    figures = run_trials(args.trials, root, base / "work", sizes=sizes, seed=args.seed, log=print)
    counters = {"kills": dict(figures.kills), "kills_by_size": dict(figures.kills_by_size)}
    as_json = [json.dumps({**figures.__dict__, **counters})] if args.json else []
    return conclude(figures.failures, [figures.summary(), *as_json], base)


def conclude(failures: Sequence[str], summary: Sequence[str], base: Path) -> int:
    """A long mode's end: prints each failure and the summary lines; keeps `base` (the root, the logs) if any
    failed, else removes it. Returns the exit code."""
    for failure in failures:
        print("FAILURE", failure)
    print("\n".join(summary))
    if failures:
        print(f"root and logs kept in {base}")
        return 1
    shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
