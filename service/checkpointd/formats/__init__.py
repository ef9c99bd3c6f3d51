"""The save-kind seam: how each kind of save is checked, written and read back, with no TensorFlow."""
