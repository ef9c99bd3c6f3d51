"""A committed save restored into the trainer: a policy save (`policies`) or a training checkpoint (`checkpoints`).

Both take the save's files through `files`: read in place on the daemon's
host (`held_files`), staged there by the daemon (`staged`), or fetched into
memory (`chunk_writer`, and `bundle_index` for a partial restore). The
modules import TensorFlow; this package's own import loads nothing.
"""
