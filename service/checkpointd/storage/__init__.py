"""The storage seam: where committed saves live (local disk), with the save manifest as the commit marker."""
