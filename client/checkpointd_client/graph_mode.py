"""TF1 graph mode: a policy built in a `tf.compat.v1.Graph` is read through a session.

In eager mode a snapshot reads each variable directly. A policy and saver
built inside `tf.compat.v1.Graph().as_default()` (as half of TF-Agents'
`policy_saver_test.testSaveAction*` cases are) have graph variables, whose
values exist only in a session. `GraphReads` holds a `ReadVariableOp` per
variable, built in the policy's graph once per set of bindings, and reads them
all in one `session.run`: one instant, like the eager copy (and `restore()`
assigns them in one run too). The session is
the one given to the saver, else the caller's default session at each call,
which is where PolicySaver's own graph-mode save reads the variables.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import gen_resource_variable_ops, resource_variable_ops
from tensorflow.python.util import object_identity

from checkpointd_client.snapshot import Bindings


def current_graph() -> tf.Graph | None:
    """The graph a policy built now lives in; None when executing eagerly."""
    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


class GraphReads:
    """Reads a graph-mode policy's variables, each save in one session run.

    Not thread-safe for building (the saver builds under its registration
    lock); reads may run from any thread, as `Session.run` may.
    """

    def __init__(self, graph: tf.Graph, train_step: tf.Variable, session: tf.compat.v1.Session | None) -> None:
        """Builds the train step's read op in `graph`.

        Args:
            graph: the graph the policy's variables live in.
            train_step: PolicySaver's step variable.
            session: the session to read in; None for the default session at each call.
        """
        self._graph = graph
        self._session = session
        self._ops = object_identity.ObjectIdentityDictionary()  # variable -> its read op
        self._step = self._read_op(train_step)
        self._fetches: tuple[Bindings, list[tf.Tensor]] | None = None
        self._assigns: tuple[Bindings, list[tf.Tensor], list[tf.Operation]] | None = None

    def session(self) -> tf.compat.v1.Session:
        """The session to read in: the saver's, else the caller's default one.

        Raises:
            ValueError: there is none, or it runs another graph.
        """
        session = self._session or tf.compat.v1.get_default_session()
        if session is None:
            raise ValueError(
                "the policy was built in graph mode, so its variables are read in a session: call "
                "inside `with session.as_default():` or give RemotePolicySaver session="
            )
        if session.graph is not self._graph:
            raise ValueError("the session runs another graph than the one the policy was built in")
        return session

    @contextlib.contextmanager
    def exporting(self) -> Iterator[None]:
        """The policy's graph and the session as defaults, for PolicySaver.save()."""
        session = self.session()
        with self._graph.as_default(), session.as_default():
            yield

    def step(self) -> int:
        """The train step now (one session run)."""
        return int(self.session().run(self._step))

    def values(self, bindings: Bindings) -> list[np.ndarray]:
        """Every bound variable's value, in bindings order, from one session run."""
        if self._fetches is None or self._fetches[0] is not bindings:
            self._fetches = (bindings, [self._read_op(b.variable) for b in bindings.variables])
        return self.session().run(self._fetches[1])

    def assign(self, bindings: Bindings, values: Sequence[np.ndarray]) -> None:
        """Assigns `values` (in bindings order) to the bound variables, in one session run."""
        if self._assigns is None or self._assigns[0] is not bindings:
            with self._graph.as_default(), tf.control_dependencies(None), tf.name_scope("checkpointd_assign"):
                feeds = [tf.compat.v1.placeholder(b.variable.dtype, b.shape) for b in bindings.variables]
                ops = [b.variable.assign(f, read_value=False) for b, f in zip(bindings.variables, feeds, strict=True)]
            self._assigns = (bindings, feeds, ops)
        _, feeds, ops = self._assigns
        self.session().run(ops, feed_dict=dict(zip(feeds, values, strict=True)))

    def _read_op(self, variable: tf.Variable) -> tf.Tensor:
        if variable not in self._ops:
            # Outside any control-dependency scope the caller is in, so a read
            # never runs (or waits for) the caller's other ops.
            with self._graph.as_default(), tf.control_dependencies(None), tf.name_scope("checkpointd_read"):
                if type(variable) is resource_variable_ops.ResourceVariable:
                    op = gen_resource_variable_ops.read_variable_op(variable.handle, variable.dtype)
                else:
                    op = tf.identity(variable)
            self._ops[variable] = op
        return self._ops[variable]
