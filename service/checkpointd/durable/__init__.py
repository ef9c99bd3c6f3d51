"""The durability toolkit below formats and storage: temp siblings, fsync, atomic publish, writeback."""

from checkpointd.durable.files import (
    fsync_below,
    fsync_dir,
    fsync_file,
    fsync_tree,
    make_temp_sibling,
    new_suffix,
    publish_dir,
    recover,
    remove_quietly,
    write_new,
)
from checkpointd.durable.writeback import (
    WRITEBACK_BYTES,
    WRITEBACK_INTERVAL,
    Writeback,
    mark_fsynced,
    release_free_memory,
    unmark_fsynced,
    writing,
)

__all__ = [
    "WRITEBACK_BYTES",
    "WRITEBACK_INTERVAL",
    "Writeback",
    "fsync_below",
    "fsync_dir",
    "fsync_file",
    "fsync_tree",
    "make_temp_sibling",
    "mark_fsynced",
    "new_suffix",
    "publish_dir",
    "recover",
    "release_free_memory",
    "remove_quietly",
    "unmark_fsynced",
    "write_new",
    "writing",
]
