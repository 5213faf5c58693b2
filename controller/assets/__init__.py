"""Files pvisor-host places into sandboxes at run time (the entry shim)."""
