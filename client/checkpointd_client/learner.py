"""A `tf_agents.train.Learner` script saving through checkpointd: the Learner and the policy trigger, together.

`tf_agents.train.Learner` builds `common.Checkpointer(root_dir/train/checkpoints,
max_to_keep, agent=agent, train_step=train_step)`, restores it, and saves it
synchronously every `checkpoint_interval` steps from an interval trigger;
`tf_agents.train.triggers.PolicySavedModelTrigger` writes the policies'
SavedModels and checkpoints under `root_dir/policies`. Here both go to one
daemon, under one folder named after the job (`run`):

| what | daemon run | where, under `<root>/<run>/` |
|---|---|---|
| the Learner's checkpoints | `<run>.train.checkpoints` | `train/checkpoints/ckpt-<step>.*` + `checkpoint` |
| the policy trigger's saves | `<run>`, `<run>.collect_policy`, `<run>.greedy_policy` | `policies/...` |

A Learner-based script swaps to checkpointd in one line, its import::

    from tf_agents.train import learner, triggers              # before
    learner, triggers = checkpointd_client.train_modules(        # after
        "localhost:7431", run="cartpole-dqn", root_dir=root_dir)

and keeps every other line: `learner.Learner(root_dir, train_step, agent, ...)`
restores from the daemon on start and saves its interval checkpoints as
non-blocking `RemoteCheckpointer` saves that never skip (`skip_if_busy=False`,
as Learner's synchronous Checkpointer never does); `triggers.PolicySavedModelTrigger(
os.path.join(root_dir, "policies"), agent, train_step, interval=...)` is a
`RemotePolicySavedModelTrigger`. Paths under `root_dir` become the same
paths under the daemon's `<root>/<run>/`; everything else of the two
modules (`StepPerSecondLogTrigger`, the dir names) is TF-Agents' own.
Summaries stay in the local `root_dir`.

Continuous saves (`continuous=True`, `budget=`: `checkpointd_client.continuous`)
go through every swap. A continuous Learner saves after every `run()` call
(its `checkpoint_interval` only switches checkpointing on or off, as a
value <= 0 does upstream) and each save decides locally, within the budget,
whether it goes; a forced trigger saves blocking. `common_module`'s
checkpointers take the options too: a classic script then calls
`save()` as often as it likes (every step) and the budget decides.

`RemoteLearner` is the Learner alone, for scripts that build their triggers
themselves. Optimizer slots: Learner creates them before it restores
(`run_optimizer_variable_init`, on by default), so they are restored at once.
"""

from __future__ import annotations

import math
import os
import threading
import types
from typing import Any

from tf_agents.policies import policy_saver as tf_policy_saver
from tf_agents.train import learner as tf_learner
from tf_agents.train import ppo_learner as tf_ppo_learner
from tf_agents.train import triggers as tf_triggers
from tf_agents.utils import common

from checkpointd.protocol.address import check_address
from checkpointd_client.checkpointer import RemoteCheckpointer
from checkpointd_client.continuous import CONTINUOUS_OPTIONS, DEFAULT_BUDGET, check_budget
from checkpointd_client.notice import NOTICE_OPTIONS, check_deadline
from checkpointd_client.saver import RemotePolicySaver
from checkpointd_client.ticket import SaveTicket
from checkpointd_client.transport.connection import CONNECTION_OPTIONS, ConnectionOptions
from checkpointd_client.transport.streams import job_name, relative_to
from checkpointd_client.trigger import POLICY_CONNECTION_OPTIONS, RemotePolicySavedModelTrigger

# Learner builds its Checkpointer through `tf_agents.train.learner.common`,
# and PPOLearner its Learner through `tf_agents.train.ppo_learner.learner`;
# swapping that name for the length of one constructor is the only seam they
# offer, so constructions are serialized (reentrant: a PPOLearner's swap
# holds it while its Learner's swap takes it again).
_SWAP = threading.RLock()


def _common_with(make: Any) -> types.ModuleType:
    """`tf_agents.utils.common` whose Checkpointer is `make`."""
    return _Proxy(common, Checkpointer=make)


class RemoteLearner(tf_learner.Learner):
    """`tf_agents.train.Learner` whose checkpoints go through checkpointd (see the module docstring).

    Takes Learner's arguments, plus the daemon's address, the job's `run`
    and RemoteCheckpointer's connection, notice (`save_on_notice`,
    `notice_deadline`) and continuous (`continuous`, `budget`) options; a
    continuous Learner saves after every `run()` within the budget (see the
    module docstring). Restores on construction as Learner does;
    `checkpointer` is its RemoteCheckpointer (tickets, flush), which by
    default saves the step reached on SIGTERM, also inside `run()`.
    """

    def __init__(
        self, root_dir: str, train_step: Any, agent: Any, *args: Any, address: str, run: str, **kwargs: Any
    ) -> None:
        options = (*CONNECTION_OPTIONS, *NOTICE_OPTIONS, *CONTINUOUS_OPTIONS)
        connection = {k: kwargs.pop(k) for k in options if k in kwargs}
        self._continuous = connection.get("continuous", False) is True  # read by _get_checkpoint_trigger
        made: list[RemoteCheckpointer] = []

        def make(ckpt_dir: str, max_to_keep: int = 20, **objects: Any) -> RemoteCheckpointer:
            # Learner's Checkpointer saves synchronously and never skips, and Learner ignores what save()
            # returns: so this one never skips either (see common_module).
            checkpointer = RemoteCheckpointer(
                relative_to(ckpt_dir, root_dir), address, run=run, max_to_keep=max_to_keep, skip_if_busy=False,
                **connection, **objects,
            )  # fmt: skip
            made.append(checkpointer)
            return checkpointer

        with _SWAP:
            original = tf_learner.common
            tf_learner.common = _common_with(make)
            try:
                super().__init__(root_dir, train_step, agent, *args, **kwargs)
            except BaseException:
                for c in made:
                    c.close()
                raise
            finally:
                tf_learner.common = original
        self.checkpointer: RemoteCheckpointer = made[-1]

    def _get_checkpoint_trigger(self, checkpoint_interval: int) -> Any:
        """Upstream's interval trigger; continuous: a save after every run() (forced: blocking), the budget deciding."""
        if not self._continuous or checkpoint_interval <= 0:
            return super()._get_checkpoint_trigger(checkpoint_interval)

        def save_every_run(_: int, force_trigger: bool = False) -> None:
            self._checkpointer.save(self.train_step, blocking=force_trigger)

        return save_every_run

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every checkpoint this Learner started is durable."""
        self.checkpointer.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flushes and closes the Learner's checkpoint run."""
        self.checkpointer.close(timeout)

    def __enter__(self) -> RemoteLearner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Proxy(types.ModuleType):
    """A module that is `real` but for `overrides`."""

    def __init__(self, real: types.ModuleType, **overrides: Any) -> None:
        super().__init__(real.__name__, real.__doc__)
        self._real = real
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def train_modules(
    address: str, *, run: str, root_dir: str | os.PathLike[str] | None = None, **connection: Any
) -> tuple[types.ModuleType, types.ModuleType]:
    """`learner, triggers` as a Learner script imports them from `tf_agents.train`, saving through checkpointd.

    Args:
        address: the daemon's `host:port`.
        run: the job's name: the daemon folder of everything it saves, and
            the base of its runs' names (see the module docstring).
        root_dir: the script's root_dir: its paths below it are saved at the
            same paths under `<root>/<run>/` on the daemon. None: paths must
            already be relative.
        **connection: RemoteCheckpointer's and RemotePolicySaver's
            connection options (channel_credentials, timeout, token, ...),
            and the Learner checkpointer's `save_on_notice`, `notice_deadline`,
            `continuous` and `budget`.

    Returns:
        Stand-ins for `tf_agents.train.learner` and `tf_agents.train.triggers`.
    """

    _check_swap(address, run, root_dir, connection, _LEARNER_OPTIONS)
    learner_module = _learner_module(address, run, connection)
    policy_options = {k: v for k, v in connection.items() if k in POLICY_CONNECTION_OPTIONS}

    class PolicySavedModelTrigger(RemotePolicySavedModelTrigger):
        def __init__(self, saved_model_dir: str, *args: Any, **kwargs: Any) -> None:
            init: Any = super().__init__  # upstream's signature, positionally: mypy cannot follow *args
            init(relative_to(saved_model_dir, root_dir), *args, address=address, run=run, **policy_options, **kwargs)

    return learner_module, _Proxy(tf_triggers, PolicySavedModelTrigger=PolicySavedModelTrigger)


def ppo_learner_module(address: str, *, run: str, **connection: Any) -> types.ModuleType:
    """`ppo_learner` as a PPO script imports it from `tf_agents.train`, saving through checkpointd.

    `PPOLearner` builds its own `learner.Learner` inside; here that one is
    `train_modules`' Learner, so its checkpoints go to the daemon as a
    Learner script's do. The swap is one line, as for `train_modules`::

        from tf_agents.train import ppo_learner                        # before
        ppo_learner = checkpointd_client.ppo_learner_module(             # after
            "localhost:7431", run="ppo-job")

    Paths are relative to the root_dir PPOLearner is given, as for a Learner.

    Args:
        address, run, **connection: as for `train_modules`.

    Returns:
        A stand-in for `tf_agents.train.ppo_learner`.
    """
    _check_swap(address, run, None, connection, _LEARNER_OPTIONS)
    learner_module = _learner_module(address, run, connection)

    class PPOLearner(tf_ppo_learner.PPOLearner):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            with _SWAP:
                original = tf_ppo_learner.learner
                tf_ppo_learner.learner = learner_module
                try:
                    super().__init__(*args, **kwargs)
                finally:
                    tf_ppo_learner.learner = original

        @property
        def checkpointer(self) -> RemoteCheckpointer:
            """The inner Learner's RemoteCheckpointer (tickets, flush, close)."""
            inner: RemoteLearner = self._generic_learner
            return inner.checkpointer

    return _Proxy(tf_ppo_learner, PPOLearner=PPOLearner)


def common_module(
    address: str, *, run: str, root_dir: str | os.PathLike[str] | None = None, **connection: Any
) -> types.ModuleType:
    """`tf_agents.utils.common` as a classic TF-Agents script imports it, its Checkpointers saving through checkpointd.

    The classic examples (`agents/dqn/examples/v2/train_eval.py` and its
    kin) keep their state in several `common.Checkpointer`s under one
    `train_dir`; here each is a `RemoteCheckpointer` of the job `run`, with
    a run of its own (`checkpointd_client.transport.streams`), saving at the same path
    under `<root>/<run>/` as it would under `root_dir`. Everything else of
    the module (`common.function`, the losses, ...) is TF-Agents' own::

        from tf_agents.utils import common                             # before
        common = checkpointd_client.common_module(                       # after
            "localhost:7431", run="cartpole-dqn", root_dir=root_dir)

    `common.Checkpointer.save` is synchronous and never skips, and the
    examples ignore what it returns; so these checkpointers never skip
    either (`skip_if_busy=False`): a save while the same checkpointer's
    previous one is still being written waits for it, then returns once its
    values are copied. The trainer waits only when it saves again before the
    daemon has written its previous save, and then only for that write.
    Its saves are durable once `flush()` returns, and at the latest when the
    process exits (the upload threads finish first). On SIGTERM each
    Checkpointer saves the step reached before the process ends
    (`save_on_notice=False` among the options turns that off). Besides
    `tf_agents.utils.common`'s names it has `checkpointers` (those it made,
    in order), `flush(timeout=None)` and `close(timeout=None)`.

    Args:
        address, run, root_dir, **connection: as for `train_modules`.

    Returns:
        A stand-in for `tf_agents.utils.common`.
    """
    _check_swap(address, run, root_dir, connection, _CHECKPOINTER_OPTIONS)
    made: list[RemoteCheckpointer] = []

    def make(ckpt_dir: str, max_to_keep: int = 20, **objects: Any) -> RemoteCheckpointer:
        checkpointer = RemoteCheckpointer(
            ckpt_dir, address, run=run, root_dir=root_dir, max_to_keep=max_to_keep, skip_if_busy=False,
            **connection, **objects,
        )  # fmt: skip
        made.append(checkpointer)
        return checkpointer

    def flush(timeout: float | None = None) -> None:
        """Waits until every checkpoint the module's checkpointers started is durable."""
        for checkpointer in made:
            checkpointer.flush(timeout)

    def close(timeout: float | None = None) -> None:
        """Flushes and closes every checkpointer the module made."""
        for checkpointer in made:
            checkpointer.close(timeout)

    return _Proxy(common, Checkpointer=make, checkpointers=made, flush=flush, close=close)


# PolicySaver's arguments after the policy, in order (a script may pass them positionally).
_POLICY_SAVER_ARGUMENTS = (
    "batch_size", "use_nest_path_signatures", "seed", "train_step", "input_fn_and_spec", "metadata",
)  # fmt: skip


def policy_saver_module(
    address: str, *, run: str, root_dir: str | os.PathLike[str] | None = None, **connection: Any
) -> types.ModuleType:
    """`tf_agents.policies.policy_saver` as a classic script imports it, its PolicySaver saving through checkpointd.

    PPO's example exports a SavedModel with `policy_saver.PolicySaver(eval_policy,
    train_step=global_step).save(os.path.join(saved_model_dir, ...))`. Here
    that PolicySaver is a `RemotePolicySaver` of the job `run` (the policy
    saver's run, `checkpointd_client.transport.streams`) whose `save` and
    `save_checkpoint` take the script's paths under `root_dir` and are
    blocking, as PolicySaver's own are: every save is written, none is
    skipped, and each returns once durable::

        from tf_agents.policies import policy_saver                      # before
        policy_saver = checkpointd_client.policy_saver_module(             # after
            "localhost:7431", run="ppo-job", root_dir=root_dir)

    Args:
        address, run, root_dir, **connection: as for `common_module`
            (connection options only).

    Returns:
        A stand-in for `tf_agents.policies.policy_saver`.
    """
    _check_swap(address, run, root_dir, connection, (*CONNECTION_OPTIONS, "incremental"))

    class PolicySaver(RemotePolicySaver):
        def __init__(self, policy: Any, *args: Any, **kwargs: Any) -> None:
            if len(args) > len(_POLICY_SAVER_ARGUMENTS):
                raise TypeError(f"PolicySaver takes at most {len(_POLICY_SAVER_ARGUMENTS) + 1} positional arguments")
            kwargs.update(zip(_POLICY_SAVER_ARGUMENTS, args, strict=False))
            super().__init__(policy, address, run=run, **connection, **kwargs)

        def save(self, export_dir: str, options: Any = None) -> SaveTicket:
            """PolicySaver.save: written through the daemon, returning once durable."""
            return super().save(relative_to(export_dir, root_dir), True, options=options)

        def save_checkpoint(self, export_dir: str, options: Any = None) -> SaveTicket:
            """PolicySaver.save_checkpoint: written through the daemon, returning once durable."""
            return super().save_checkpoint(relative_to(export_dir, root_dir), True, options=options)

    return _Proxy(tf_policy_saver, PolicySaver=PolicySaver)


# What common_module passes on to every RemoteCheckpointer besides the connection.
_CHECKPOINTER_OPTIONS = (
    *CONNECTION_OPTIONS, *NOTICE_OPTIONS, *CONTINUOUS_OPTIONS, "incremental", "keep_checkpoint_every_n_hours",
)  # fmt: skip
# What the Learner swaps pass on to the Learner's RemoteCheckpointer.
_LEARNER_OPTIONS = (*CONNECTION_OPTIONS, *NOTICE_OPTIONS, *CONTINUOUS_OPTIONS)


def _check_swap(
    address: str,
    run: str,
    root_dir: str | os.PathLike[str] | None,
    connection: dict[str, Any],
    allowed: tuple[str, ...],
) -> None:
    """Checks a module swap's arguments now, each named, so that none fails when the script builds a saver.

    Raises:
        TypeError: an option the swapped savers do not take.
        ValueError: an invalid address, run, root_dir or option value.
    """
    unknown = sorted(set(connection) - set(allowed))
    if unknown:
        raise TypeError(f"unexpected option(s) {', '.join(unknown)}; the savers take {', '.join(allowed)}")
    check_address(address)
    job_name(run, None)
    if root_dir is not None and not isinstance(root_dir, str | os.PathLike):
        raise ValueError(f"root_dir must be a path or None, saw {type(root_dir)!r}")
    ConnectionOptions(**{k: v for k, v in connection.items() if k in CONNECTION_OPTIONS})
    for flag in ("incremental", "save_on_notice", "continuous"):
        if not isinstance(connection.get(flag, True), bool):
            raise ValueError(f"{flag} must be True or False, got {connection[flag]!r}")
    if "notice_deadline" in connection:
        check_deadline(connection["notice_deadline"])
    if "budget" in connection:
        check_budget(connection["budget"])
        if connection["budget"] != DEFAULT_BUDGET and connection.get("continuous") is not True:
            raise ValueError(f"budget={connection['budget']!r} applies to continuous saves: pass continuous=True too")
    hours = connection.get("keep_checkpoint_every_n_hours")
    if hours is not None and not (
        isinstance(hours, int | float) and not isinstance(hours, bool) and 0 < hours < math.inf
    ):
        raise ValueError(f"keep_checkpoint_every_n_hours must be a finite number of hours > 0, or None; got {hours!r}")


def _learner_module(address: str, run: str, connection: dict[str, Any]) -> types.ModuleType:
    """`tf_agents.train.learner` whose Learner is a RemoteLearner, called as upstream's (positionally or by keyword)."""

    class Learner(RemoteLearner):
        def __init__(self, root_dir: str, train_step: Any, agent: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(root_dir, train_step, agent, *args, address=address, run=run, **connection, **kwargs)

    return _Proxy(tf_learner, Learner=Learner)
