"""RemotePolicySavedModelTrigger: TF-Agents' PolicySavedModelTrigger, saving through checkpointd.

Upstream (`tf_agents.train.triggers.PolicySavedModelTrigger`) writes, under
its `saved_model_dir`:

- at construction, a SavedModel of each policy that has none there yet
  (it checks for `policy_specs.pbtxt`): `policy` (the raw policy; the
  wrapped one if `agent.policy` is a GreedyPolicy), `collect_policy` and
  `greedy_policy`;
- every `interval` train steps, the raw policy's `save_checkpoint` at
  `checkpoints/policy_checkpoint_%010d` (the train step), after
  `agent.post_process_policy()` and after copying each metadata metric's
  `result()` into its metadata variable.

This trigger writes the same dirs, at the same moments, through the daemon,
under `<root>/<run>/<saved_model_dir>/`. A daemon run holds one template, so
the three policies are three runs sharing the folder `<run>`:

| policy | daemon run | export dirs (relative to `<root>/<run>/`) |
|---|---|---|
| raw | `<run>` | `<saved_model_dir>/policy`, `<saved_model_dir>/checkpoints/policy_checkpoint_N` |
| collect | `<run>.collect_policy` | `<saved_model_dir>/collect_policy` |
| greedy | `<run>.greedy_policy` | `<saved_model_dir>/greedy_policy` |

The raw policy's run carries the checkpoints (and the NumpyState, if any), so
`checkpointd status --run <run>`, `latest()` and `restore()` speak of the run
the trainer named. The initial SavedModels are skipped when the daemon already
holds a committed SavedModel of that run at that dir (a restarted trainer),
as upstream skips an existing one.

Differences from upstream, on purpose:
- Saving is always asynchronous: the values are copied at the call, so the
  reason upstream refuses `metadata_metrics` with `async_saving` (the saved
  values would not be those of the call) is gone; both work together.
  `async_saving` is accepted and ignored.
- `trigger(step, force_trigger=True)` (the final save of a loop) blocks until
  the checkpoint is durable, and is never skipped. A periodic save that finds
  the previous one still in flight is skipped, as AsyncPolicySaver skips it,
  but the skip is counted and logged.
- The initial SavedModels are durable when the constructor returns.
- `close()` flushes and closes the three runs; `restore()` brings back the
  newest checkpoint (or any save) of the raw policy's run.
"""

from __future__ import annotations

import logging
import os
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import tensorflow as tf
from tf_agents.agents import tf_agent
from tf_agents.metrics import py_metric
from tf_agents.policies import greedy_policy, policy_saver
from tf_agents.train import interval_trigger, learner
from tf_agents.utils import numpy_storage

from checkpointd.protocol.errors import CheckpointdError
from checkpointd.protocol.kinds import SaveKind
from checkpointd.protocol.names import check_export_dir, check_run_name
from checkpointd_client.restore.policies import LatestSave
from checkpointd_client.saver import RemotePolicySaver
from checkpointd_client.ticket import SaveTicket

_LOGGER = logging.getLogger(__name__)

POLICY_CONNECTION_OPTIONS = ("channel_credentials", "timeout", "token", "token_file")
"""The connection options (`session.ConnectionOptions`) this trigger takes and gives its savers."""


class RemotePolicySavedModelTrigger(interval_trigger.IntervalTrigger):
    """Saves an agent's greedy, collect and raw policies through checkpointd.

    A drop-in for `PolicySavedModelTrigger` in a `tf_agents.train.Learner`'s
    triggers: same arguments, plus `address` and `run`.
    """

    def __init__(
        self,
        saved_model_dir: str,
        agent: tf_agent.TFAgent,
        train_step: tf.Variable,
        interval: int,
        async_saving: bool = False,
        metadata_metrics: Mapping[str, py_metric.PyMetric] | None = None,
        start: int = 0,
        extra_concrete_functions: Sequence[tuple[str, Any]] | None = None,
        batch_size: int | None = None,
        use_nest_path_signatures: bool = True,
        save_greedy_policy: bool = True,
        save_collect_policy: bool = True,
        input_fn_and_spec: policy_saver.InputFnAndSpecType | None = None,
        *,
        address: str,
        run: str,
        numpy_state: numpy_storage.NumpyState | None = None,
        channel_credentials: grpc.ChannelCredentials | None = None,
        timeout: float | None = None,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
    ) -> None:
        """Builds the three savers and writes the initial SavedModels through the daemon.

        Args:
            saved_model_dir: the base dir, relative to `<root>/<run>/` on the
                daemon (upstream: `os.path.join(root_dir, "policies")`, here
                e.g. "policies").
            agent, train_step, interval, metadata_metrics, start,
                extra_concrete_functions, batch_size, use_nest_path_signatures,
                save_greedy_policy, save_collect_policy, input_fn_and_spec:
                as for PolicySavedModelTrigger.
            async_saving: ignored: saves are always asynchronous (see the
                module docstring).
            address: the daemon's `host:port`.
            run: the run's name, and its folder under the daemon's root; the
                collect and greedy policies use `<run>.collect_policy` and
                `<run>.greedy_policy` (so `run` has at most 113 characters).
            numpy_state: a NumpyState saved with the raw policy's saves.
            channel_credentials, timeout, token, token_file: as for
                RemotePolicySaver.

        Raises:
            ValueError: an invalid run name or `saved_model_dir`.
            CheckpointdError: the daemon refused a registration or a save, or
                cannot be reached.
        """
        del async_saving  # always asynchronous; see the module docstring
        try:
            base = "" if saved_model_dir in ("", ".") else str(check_export_dir(saved_model_dir))
            for name in (run, f"{run}.{learner.COLLECT_POLICY_SAVED_MODEL_DIR}"):
                check_run_name(name)
        except CheckpointdError as e:
            raise ValueError(str(e)) from None
        self._agent = agent
        self._train_step = train_step
        self._metadata_metrics = dict(metadata_metrics or {})
        self._metadata = {
            k: tf.Variable(0, dtype=v.result().dtype, shape=v.result().shape) for k, v in self._metadata_metrics.items()
        }
        self._blocking = False
        self._last_ticket: SaveTicket | None = None

        if isinstance(agent.policy, greedy_policy.GreedyPolicy):
            raw_policy, greedy = agent.policy.wrapped_policy, agent.policy
        else:
            raw_policy = agent.policy
            greedy = greedy_policy.GreedyPolicy(agent.policy) if save_greedy_policy else None

        def saver(policy: Any, name: str, state: Any = None) -> RemotePolicySaver:
            return RemotePolicySaver(
                policy, address, run=name, folder=run, batch_size=batch_size,
                use_nest_path_signatures=use_nest_path_signatures, train_step=train_step,
                metadata=self._metadata, input_fn_and_spec=input_fn_and_spec,
                numpy_state=state, channel_credentials=channel_credentials, timeout=timeout,
                token=token, token_file=token_file,
            )  # fmt: skip

        self._raw_saver = saver(raw_policy, run, numpy_state)
        self._savers = {learner.RAW_POLICY_SAVED_MODEL_DIR: self._raw_saver}
        if save_collect_policy:
            name = f"{run}.{learner.COLLECT_POLICY_SAVED_MODEL_DIR}"
            self._savers[learner.COLLECT_POLICY_SAVED_MODEL_DIR] = saver(agent.collect_policy, name)
        if save_greedy_policy:
            name = f"{run}.{learner.GREEDY_POLICY_SAVED_MODEL_DIR}"
            self._savers[learner.GREEDY_POLICY_SAVED_MODEL_DIR] = saver(greedy, name)
        for s in self._savers.values():
            for name, fn in extra_concrete_functions or ():
                s.register_concrete_function(name, fn)

        self._checkpoint_dir = posixpath.join(base, learner.POLICY_CHECKPOINT_DIR)
        try:
            for path, s in self._savers.items():
                export_dir = posixpath.join(base, path)
                found = s.latest(SaveKind.SAVED_MODEL)
                if found is not None and found.export_dir == export_dir:
                    msg = "run %s: %s exists (step %d); not saved again"
                    _LOGGER.info(msg, s.run, export_dir, found.step)
                    continue
                s.save(export_dir, blocking=True)
        except BaseException:
            self.close()
            raise
        super().__init__(interval, self._save_fn, start=start)

    @property
    def saver(self) -> RemotePolicySaver:
        """The raw policy's saver: its run holds the checkpoints."""
        return self._raw_saver

    @property
    def savers(self) -> dict[str, RemotePolicySaver]:
        """Every saver, by the dir name of its SavedModel ("policy", "collect_policy", ...)."""
        return dict(self._savers)

    @property
    def last_ticket(self) -> SaveTicket | None:
        """The ticket of the newest checkpoint save this trigger made, if any."""
        return self._last_ticket

    def __call__(self, value: int, force_trigger: bool = False) -> None:
        """Saves a checkpoint if `interval` steps passed; `force_trigger` saves and blocks.

        Args:
            value: the current train step.
            force_trigger: save now unless the last save was at `value`, and
                wait until the checkpoint is durable (the final save of a loop).

        Raises:
            CheckpointdError: with `force_trigger`, the save's own error; else
                only errors the daemon answered before accepting the save.
        """
        self._blocking = force_trigger
        try:
            super().__call__(value, force_trigger)
        finally:
            self._blocking = False

    def _save_fn(self) -> None:
        self._agent.post_process_policy()
        for k, v in self._metadata_metrics.items():
            self._metadata[k].assign(v.result())
        export_dir = posixpath.join(self._checkpoint_dir, f"policy_checkpoint_{int(self._train_step.numpy()):010d}")
        self._last_ticket = self._raw_saver.save_checkpoint(export_dir, blocking=self._blocking)

    def latest(self, kind: SaveKind | None = None) -> LatestSave | None:
        """The raw policy run's newest committed save (see RemotePolicySaver.latest)."""
        return self._raw_saver.latest(kind)

    def restore(self, export_dir: str | None = None) -> LatestSave:
        """Restores the raw policy, train_step, metadata and numpy state from the daemon.

        The collect and greedy policies of TF-Agents agents share the raw
        policy's variables, so they are restored too. The trigger then counts
        its interval from the restored step, as a Learner that restored its
        own checkpoint sets it (`set_start`).

        Args:
            export_dir: relative to `<root>/<run>/`; None for the newest save.

        Returns:
            The save restored.
        """
        restored = self._raw_saver.restore(export_dir)
        self.set_start(restored.step)
        return restored

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every save of the trigger is durable."""
        for s in self._savers.values():
            s.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flushes, then closes the three runs on the daemon."""
        errors = []
        for s in self._savers.values():
            try:
                s.close(timeout)
            except CheckpointdError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> RemotePolicySavedModelTrigger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
