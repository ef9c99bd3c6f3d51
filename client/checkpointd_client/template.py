"""The template: PolicySaver's own export of the policy, uploaded when a run registers.

The daemon reuses the template's graph for every save of the run and writes
only new variable values into it, so the trainer pays for PolicySaver's
graph building once per template instead of once per save.

A template is graph, specs and assets: the export's variable values are
dropped before the upload (`drop_variable_data`), since every save
overwrites them. What the daemon needs of the export's checkpoint is its
index (each variable's key, dtype and shape) and the object graph TensorFlow
stored beside the values, which every SAVED_MODEL save holds again; the
object graph travels as `variables/object_graph.pb`. So registration
sends, checks and fsyncs graph, specs and assets only, never the policy's
weights. The export itself still writes the values to a local temp dir:
`tf.saved_model.save` has no public way to build the graph without them
(see `register`).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator

import tensorflow as tf
from tf_agents.policies import policy_saver

from checkpointd.protocol import tensors, wire
from checkpointd.v1 import checkpointd_pb2 as pb
from checkpointd_client import snapshot
from checkpointd_client.transport.session import DaemonSession

_LOGGER = logging.getLogger(__name__)


def register(
    daemon: DaemonSession,
    saver: policy_saver.PolicySaver,
    *,
    folder: str | None = None,
    options: tf.saved_model.SaveOptions | None = None,
    exporting: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
) -> snapshot.Bindings:
    """Exports the template, binds the policy's variables and registers the run.

    The template is exported to a temp dir, its variable values dropped
    (`drop_variable_data`), streamed file by file, and deleted. The export
    still writes the values before they are dropped: `tf.saved_model.save`
    skips its checkpoint only through a private function that then yields
    no object graph either, and the daemon must write that graph byte for
    byte, so building it apart would mean TensorFlow's internals; a
    checkpoint of placeholder variables would change the graph. Written to
    a temp dir and deleted at once, the values cost memory bandwidth, not
    disk writes.

    Args:
        daemon: the run's session (its name, chunk size and deadline).
        saver: the PolicySaver to export with.
        folder: the run's folder under the daemon's root; None for the run's name.
        options: PolicySaver.save's options for the export (checked by
            `checkpointd_client.options.template_options`).
        exporting: the context the export and binding run in (a graph-mode
            policy's graph and session, `GraphReads.exporting`).

    Returns:
        The bindings, in the order of the manifest the daemon answered.

    Raises:
        ValueError: if the variables cannot be bound (see `snapshot.bind`), or
            the daemon's manifest does not describe them.
        CheckpointdError: a subclass for the status the daemon answered
            (UnavailableError and DeadlineError name the address).
    """
    run, step = daemon.run, daemon.last_step
    start = time.monotonic()
    template = tempfile.mkdtemp(prefix=f"checkpointd-{run}-template-")
    try:
        with exporting():
            saver.save(template, options=options)
            bindings = snapshot.bind(saver, template)
        drop_variable_data(template)
        exported = time.monotonic()
        header = pb.RegisterRunHeader(
            run=run,
            variables=bindings.protos(),
            checkpoint_object_graph=bindings.object_graph,
            template_bytes=wire.template_size(template),
            folder=folder or "",
        )
        requests = _requests(header, template, daemon.chunk_bytes)
        response = daemon.register_run(requests, f"registering run {run!r}")
    finally:
        shutil.rmtree(template, ignore_errors=True)
    bindings = bindings.ordered(response.variables)
    _LOGGER.info(
        "run %s: registered at step %s (%s variables, template of %s bytes; export %.2f s, register %.2f s)",
        run,
        step,
        len(bindings.variables),
        header.template_bytes,
        exported - start,
        time.monotonic() - exported,
    )
    return bindings


def drop_variable_data(export_dir: str) -> None:
    """Turns a PolicySaver.save() output into the template RegisterRun takes.

    Writes the checkpoint's object graph to `variables/object_graph.pb` and
    deletes the data shards, keeping `variables/variables.index`. Reading
    the object graph reads only its own bytes, at the end of the data shard.

    Args:
        export_dir: a directory PolicySaver.save() wrote; changed in place.
    """
    prefix = os.path.join(export_dir, tf.saved_model.VARIABLES_DIRECTORY, tf.saved_model.VARIABLES_FILENAME)
    graph = tf.train.load_checkpoint(prefix).get_tensor(tensors.OBJECT_GRAPH_KEY)
    with open(os.path.join(export_dir, tensors.TEMPLATE_OBJECT_GRAPH), "wb") as f:
        f.write(graph)
    for shard in glob.glob(glob.escape(prefix) + ".data-*"):
        os.remove(shard)


def _requests(header: pb.RegisterRunHeader, template: str, chunk_bytes: int) -> Iterator[pb.RegisterRunRequest]:
    # Read lazily as gRPC sends: a large template is never held in memory whole.
    yield pb.RegisterRunRequest(header=header)
    for chunk in wire.template_chunks(template, chunk_bytes):
        yield pb.RegisterRunRequest(chunk=chunk)
