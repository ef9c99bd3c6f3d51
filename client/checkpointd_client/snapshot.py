"""Variable bindings, and point-in-time snapshots of their values.

A *binding* ties one live `tf.Variable` of the policy to the two names TF gives
it on disk: its key in the SavedModel's `variables/` checkpoint and its key in
`PolicySaver.save_checkpoint`'s checkpoint. Both come from TF's own
breadth-first object-graph naming, so the daemon can write either layout
without TF ever walking the policy on its side.

A *snapshot* is the values of the bound variables at one instant, as host
NumPy arrays copied from the variables' memory, in manifest order. It is
never concatenated: its chunks (`checkpointd.protocol.wire`) are slices of
each array's bytes, with offsets over the concatenation, so a save costs one
host copy of the model and no more.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import tensorflow as tf
from tensorflow.python.checkpoint import graph_view, save_util
from tensorflow.python.ops import gen_resource_variable_ops, resource_variable_ops
from tensorflow.python.trackable import trackable_utils
from tensorflow.python.util import object_identity
from tf_agents.policies import policy_saver

from checkpointd.protocol import tensors, wire
from checkpointd.v1 import checkpointd_pb2
from checkpointd_client.numpy_state import NumpySnapshot


@dataclass(frozen=True)
class Binding:
    """One policy variable and its keys in both of PolicySaver's checkpoints."""

    key: str
    checkpoint_key: str
    dtype: str
    shape: tuple[int, ...]
    variable: tf.Variable

    def to_proto(self) -> checkpointd_pb2.Variable:
        return wire.variable_to_pb(self)


@dataclass(frozen=True)
class Bindings:
    """Every variable of a policy, sorted by key, and the checkpoint object graph."""

    variables: tuple[Binding, ...]
    # The serialized TrackableObjectGraph PolicySaver.save_checkpoint writes.
    object_graph: bytes

    def protos(self) -> list[checkpointd_pb2.Variable]:
        """New messages of the variables, the caller's to change."""
        return [b.to_proto() for b in self.variables]

    @functools.cached_property
    def header_protos(self) -> tuple[checkpointd_pb2.Variable, ...]:
        """The same messages, built once and shared: every save's header copies them. Do not change them."""
        return tuple(b.to_proto() for b in self.variables)

    def ordered(self, manifest: Sequence[checkpointd_pb2.Variable]) -> Bindings:
        """These bindings in the order of the daemon's manifest.

        Raises:
            ValueError: if the manifest names other variables, dtypes or shapes.
        """
        by_key = {b.key: b for b in self.variables}
        ordered = []
        for spec in manifest:
            b = by_key.pop(spec.key, None)
            if b is None or b.to_proto() != spec:
                raise ValueError(
                    f"the daemon's manifest has {spec.key!r} as {spec.dtype}{list(spec.shape)}; "
                    f"the policy has {f'{b.dtype}{list(b.shape)}' if b else 'no such variable'}"
                )
            ordered.append(b)
        if by_key:
            raise ValueError(f"the daemon's manifest lacks variables {sorted(by_key)}")
        return Bindings(tuple(ordered), self.object_graph)


def bfs_keys(root: tf.Module) -> dict[str, tf.Variable]:
    """Checkpoint key -> variable, exactly as TF names the entries it writes for `root`."""
    objects, paths = graph_view.ObjectGraphView(root).breadth_first_traversal()
    return {
        trackable_utils.object_path_to_string(paths[o]) + tensors.VARIABLE_SUFFIX: o
        for o in objects
        if isinstance(o, tf.Variable)
    }


def bind(saver: policy_saver.PolicySaver, template_dir: str) -> Bindings:
    """Binds the variables of `saver.policy` to their keys in both checkpoints.

    Args:
        saver: the PolicySaver whose policy the template was exported from.
        template_dir: the directory `saver.save()` wrote.

    Returns:
        The bindings, sorted by SavedModel key.

    Raises:
        ValueError: if a variable is missing from one of the two checkpoints,
            if the template's checkpoint has other keys than the policy's
            object graph, or if a variable has a dtype or shape the daemon
            cannot carry.
    """
    saved_model = bfs_keys(saver.policy)
    root = _layout_root(saver)
    checkpoint_keys = object_identity.ObjectIdentityDictionary()
    for key, var in bfs_keys(root).items():
        checkpoint_keys[var] = key
    template = _template_keys(template_dir)
    if set(saved_model) != template:
        raise ValueError(
            "the template SavedModel's checkpoint does not hold the policy's variables as TF's "
            "object graph names them; only in the template: "
            f"{sorted(template - set(saved_model))}, only in the policy: "
            f"{sorted(set(saved_model) - template)}"
        )
    bound = object_identity.ObjectIdentitySet()
    bindings = []
    for key in sorted(saved_model):
        var = saved_model[key]
        if var not in checkpoint_keys:
            raise ValueError(
                f"variable {key!r} is in the SavedModel but not in the checkpoint "
                "PolicySaver.save_checkpoint writes (policy, model_variables, train_step); "
                "the daemon could not write it in a save_checkpoint()"
            )
        bound.add(var)
        bindings.append(_binding(key, checkpoint_keys[var], var))
    extra = [k for v, k in checkpoint_keys.items() if v not in bound]
    if extra:
        raise ValueError(f"variables {sorted(extra)} are in save_checkpoint's checkpoint only")
    graph = save_util.serialize_graph_view(graph_view.ObjectGraphView(root))[3]
    return Bindings(tuple(bindings), graph.SerializeToString())


def checkpoint_root(saver: policy_saver.PolicySaver) -> tf.train.Checkpoint:
    """The root PolicySaver.save_checkpoint builds, or what building it raises.

    Raises:
        ValueError: the policy has no variables (TF's Checkpoint refuses
            `model_variables=()`), exactly as PolicySaver.save_checkpoint raises.
    """
    # _train_step is the variable PolicySaver was given (or made), which it
    # exposes no other way.
    return tf.train.Checkpoint(
        policy=saver.policy,
        model_variables=saver.policy.model_variables,
        train_step=saver._train_step,  # noqa: SLF001 - see above
    )


def _layout_root(saver: policy_saver.PolicySaver) -> tf.train.Checkpoint:
    """checkpoint_root(), or for a policy without variables the same root less model_variables.

    Such a policy's save_checkpoint() is refused on the trainer (it raises
    checkpoint_root's error, as PolicySaver does), but its save() works, and
    registering still needs checkpoint keys for its train step and metadata.
    """
    if saver.policy.model_variables:
        return checkpoint_root(saver)
    return tf.train.Checkpoint(policy=saver.policy, train_step=saver._train_step)  # noqa: SLF001


def _template_keys(template_dir: str) -> set[str]:
    prefix = os.path.join(template_dir, tf.saved_model.VARIABLES_DIRECTORY, tf.saved_model.VARIABLES_FILENAME)
    keys = set(tf.train.load_checkpoint(prefix).get_variable_to_shape_map())
    keys.discard(tensors.OBJECT_GRAPH_KEY)
    return keys


def _binding(key: str, checkpoint_key: str, var: tf.Variable) -> Binding:
    dtype = var.dtype.name
    if dtype not in tensors.ITEMSIZE:
        raise ValueError(
            f"variable {key!r} has dtype {dtype}; checkpointd carries {', '.join(sorted(tensors.ITEMSIZE))}"
        )
    if not var.shape.is_fully_defined():
        raise ValueError(f"variable {key!r} has a partly unknown shape {var.shape}")
    return Binding(key, checkpoint_key, dtype, tuple(var.shape.as_list()), var)


@dataclass(frozen=True)
class Snapshot:
    """The values of bound variables at one instant, in manifest order.

    `numpy_state`, taken at the same instant, travels after the variables.
    """

    keys: tuple[str, ...]
    arrays: tuple[np.ndarray, ...]
    step: int
    numpy_state: NumpySnapshot | None = None

    @property
    def nbytes(self) -> int:
        extra = self.numpy_state.nbytes if self.numpy_state is not None else 0
        return sum(a.nbytes for a in self.arrays) + extra

    def parts(self) -> Iterator[memoryview]:
        """The snapshot's bytes in wire order, one view per part: each variable, then each numpy entry."""
        for array in self.arrays:
            yield wire.byte_view(array)
        if self.numpy_state is not None:
            for value in self.numpy_state.values:
                yield memoryview(value)

    def encoded_chunks(self, chunk_bytes: int) -> Iterator[bytes]:
        """The snapshot's chunks, each serialized as a SaveRequest (`wire.save_request_chunks`)."""
        return wire.save_request_chunks(self.parts(), chunk_bytes)


def take_snapshot(
    bindings: Bindings,
    train_step: tf.Variable,
    *,
    numpy_state: NumpySnapshot | None = None,
    into: Sequence[np.ndarray] | None = None,
    values: Sequence[np.ndarray] | None = None,
) -> Snapshot:
    """Copies every bound variable (and the numpy state) to host memory now.

    The step comes from the same copy.

    Args:
        bindings: the variables to copy.
        train_step: the step variable (read on its own if it is not bound).
        numpy_state: the NumpyState, serialized at the same call.
        into: arrays of a previous snapshot of the same bindings, no longer in
            use, to copy into: memory already touched copies without the
            page faults that fresh memory takes on its first write.
        values: the variables' values already read at this instant, in
            bindings order (a graph-mode policy's one session run,
            `checkpointd_client.graph_mode`); None reads each variable now.
    """
    pairs = [
        _target(b, into[i] if into is not None else None, values[i] if values is not None else None)
        for i, b in enumerate(bindings.variables)
    ]
    copy_all(pairs)
    arrays = tuple(wire.little_endian(target) for target, _ in pairs)
    step = None
    for b, a in zip(bindings.variables, arrays, strict=True):
        if b.variable is train_step:
            step = int(a)
    if step is None:  # PolicySaver always tracks it; read it anyway rather than guess.
        step = int(train_step.numpy())
    return Snapshot(tuple(b.key for b in bindings.variables), arrays, step, numpy_state)


def _target(binding: Binding, into: np.ndarray | None, read: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(where to copy, the variable's value now) for one binding; `read`: the value already read."""
    # The read tensor's own memory, without the copy .numpy() makes; it is
    # released after the copy, so the trainer's next update writes in place.
    value = np.asarray(read_variable(binding.variable)) if read is None else read
    if into is None and read is not None and read.flags.owndata and read.flags.c_contiguous:
        return read, read  # a session run's own fresh copy: kept as it is
    if into is None or into.shape != value.shape or into.dtype != value.dtype:
        into = np.empty_like(value, order="C")
    return into, value


def read_variable(variable: tf.Variable) -> tf.Tensor:
    """The variable's value now: ReadVariableOp itself for a plain resource variable.

    `value()` adds tape and distribution bookkeeping to every read, which a
    snapshot has no use for; other variable types keep it.
    """
    if type(variable) is resource_variable_ops.ResourceVariable:
        return gen_resource_variable_ops.read_variable_op(variable.handle, variable.dtype)
    return variable.value()


# Arrays this large are copied in pieces, one per core: the trainer waits
# for the copy, and one core's memcpy leaves the others' bandwidth unused.
_SPLIT_BYTES = 4 << 20
_CORES = max(1, min(4, os.cpu_count() or 1))
_copiers = ThreadPoolExecutor(max_workers=max(1, _CORES - 1), thread_name_prefix="checkpointd-copy")


def copy_all(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """np.copyto(dst, src) for every (dst, src) pair, large ones in parallel pieces.

    NumPy releases the GIL while it copies, so the pieces run at once on
    this thread and the copier threads.
    """
    pending = []
    for dst, src in pairs:
        if dst is src:
            continue
        if (
            dst.nbytes < _SPLIT_BYTES
            or _CORES == 1
            or not (dst.flags.c_contiguous and src.flags.c_contiguous and dst.dtype == src.dtype)
        ):
            np.copyto(dst, src)
            continue
        flat_dst, flat_src = dst.reshape(-1), src.reshape(-1)
        bounds = np.linspace(0, flat_dst.size, _CORES + 1).astype(int)
        for lo, hi in zip(bounds[1:-1], bounds[2:], strict=True):
            pending.append(_copiers.submit(np.copyto, flat_dst[lo:hi], flat_src[lo:hi]))
        np.copyto(flat_dst[: bounds[1]], flat_src[: bounds[1]])
    for future in pending:
        future.result()


def nbytes(bindings: Bindings) -> int:
    """The bytes of one snapshot of `bindings`' variables (numpy state aside)."""
    return sum(tensors.nbytes(b.dtype, b.shape) for b in bindings.variables)
