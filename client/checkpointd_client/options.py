"""PolicySaver's `options=`: what each option means for a save checkpointd writes.

The daemon writes every save from the run's template (PolicySaver's own
export, made on the trainer) plus a snapshot's values, so an option acts
where the thing it changes is made:

`tf.saved_model.SaveOptions` (`save(options=...)`):
- namespace_whitelist, save_debug_info, function_aliases,
  experimental_variable_policy, experimental_custom_gradients,
  experimental_skip_saver: they shape the exported graph, so they apply at
  template export. A save whose options differ from the current template's
  exports and registers the template again first; the saves after it keep
  the new template until options differ again (`save_checkpoint()` writes
  variables only and never changes it).
- experimental_io_device: refused. It picks the trainer-side device that
  writes the variables; the daemon writes them on its own host.
- experimental_image_format: refused (TF disables it outside Google); the
  daemon reads and copies `saved_model.pb`.

`tf.train.CheckpointOptions` (`save_checkpoint(options=...)`):
- experimental_io_device: refused, as above.
- enable_async (and experimental_enable_async_checkpoint): accepted; a
  non-blocking save is written in the background anyway, and `blocking=True`
  still waits.
- experimental_write_callbacks: called on the trainer, in order, once the
  daemon reports the checkpoint durable, with the daemon's file prefix
  (`<export_dir on the daemon>/variables/variables`) if they take an
  argument, as TF's write() calls them; never for a skipped or failed save.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import tensorflow as tf

# SaveOptions fields that change the exported template.
_TEMPLATE_FIELDS = (
    "namespace_whitelist",
    "save_debug_info",
    "function_aliases",
    "experimental_variable_policy",
    "experimental_custom_gradients",
    "experimental_skip_saver",
)
_REMOTE_IO = "the daemon writes the variables on its own host, so a device of the trainer's cannot apply; drop it"
# Refused when set: field -> why.
_SAVE_REFUSED = {
    "experimental_io_device": _REMOTE_IO,
    "experimental_image_format": "the daemon reads and copies the template's saved_model.pb",
}
_CHECKPOINT_REFUSED = {"experimental_io_device": _REMOTE_IO}
_CHECKPOINT_ACCEPTED = ("experimental_enable_async_checkpoint", "enable_async", "experimental_write_callbacks")

WriteCallback = Callable[..., Any]


def template_options(options: tf.saved_model.SaveOptions | None) -> tf.saved_model.SaveOptions | None:
    """Checks save()'s options; returns them for the template export.

    Raises:
        TypeError: `options` is not a tf.saved_model.SaveOptions.
        ValueError: it sets an option that cannot apply to a save the daemon
            writes (the message names the option and why).
    """
    if options is None:
        return None
    if not isinstance(options, tf.saved_model.SaveOptions):
        raise TypeError(f"save(options=...) takes a tf.saved_model.SaveOptions, saw {type(options)!r}")
    _refuse(options, tf.saved_model.SaveOptions(), "SaveOptions", _SAVE_REFUSED, _TEMPLATE_FIELDS)
    return options


def template_key(options: tf.saved_model.SaveOptions | None) -> tuple[Hashable, ...]:
    """What of `options` shapes the template: equal keys export equal templates.

    None and SaveOptions() have the same key. Functions in function_aliases
    count by identity, so the caller keeps `options` alive with its key.
    """
    options = options or tf.saved_model.SaveOptions()
    key: list[Hashable] = []
    for name in _TEMPLATE_FIELDS:
        value = getattr(options, name)
        if name == "function_aliases":
            value = tuple(sorted((alias, id(fn)) for alias, fn in (value or {}).items()))
        elif name == "namespace_whitelist":
            value = tuple(value) if value is not None else None
        key.append(value)
    return tuple(key)


def write_callbacks(options: tf.train.CheckpointOptions | None) -> tuple[WriteCallback, ...]:
    """Checks save_checkpoint()'s options; returns the write callbacks to call once durable.

    Raises:
        TypeError: `options` is not a tf.train.CheckpointOptions, or a
            callback takes more than one argument (TF would raise after writing).
        ValueError: it sets an option that cannot apply to a save the daemon writes.
    """
    if options is None:
        return ()
    if not isinstance(options, tf.train.CheckpointOptions):
        raise TypeError(f"save_checkpoint(options=...) takes a tf.train.CheckpointOptions, saw {type(options)!r}")
    _refuse(options, tf.train.CheckpointOptions(), "CheckpointOptions", _CHECKPOINT_REFUSED, _CHECKPOINT_ACCEPTED)
    callbacks = tuple(options.experimental_write_callbacks or ())
    for callback in callbacks:
        if len(inspect.signature(callback).parameters) > 1:
            raise TypeError(
                f"CheckpointOptions.experimental_write_callbacks: {callback!r} takes more than one "
                "argument; a write callback takes none or the save path"
            )
    return callbacks


def call_write_callbacks(callbacks: Sequence[WriteCallback], export_path: str) -> None:
    """Calls each callback as TF's Checkpoint.write does, with the checkpoint's file prefix."""
    prefix = os.path.join(export_path, tf.saved_model.VARIABLES_DIRECTORY, tf.saved_model.VARIABLES_FILENAME)
    for callback in callbacks:
        if inspect.signature(callback).parameters:
            callback(prefix)
        else:
            callback()


def _refuse(options: object, default: object, what: str, refused: dict[str, str], accepted: Sequence[str]) -> None:
    """Raises ValueError for a refused option that is set, or an unknown one that differs from its default."""
    for name in type(options).__slots__:  # type: ignore[attr-defined]
        value = getattr(options, name)
        if name in refused:
            if value != getattr(default, name):
                raise ValueError(f"{what}.{name}={value!r} is not supported through checkpointd: {refused[name]}")
        elif name not in accepted and value != getattr(default, name):
            raise ValueError(
                f"{what}.{name}={value!r} is not supported through checkpointd: this TensorFlow's option "
                "is unknown to it, so what it would change in the daemon's output is unknown"
            )


def options_in_blocking(blocking: Any, options: Any, options_type: type) -> tuple[bool, Any]:
    """(blocking, options), taking an options object passed positionally as PolicySaver's second argument.

    PolicySaver's save(export_dir, options) and AsyncPolicySaver's
    save(export_dir, blocking) share the position; the type tells them apart.

    Raises:
        TypeError: options were given both ways.
    """
    if not isinstance(blocking, options_type):
        return bool(blocking), options
    if options is not None:
        raise TypeError("options given twice: as the second argument and as options=")
    return False, blocking
