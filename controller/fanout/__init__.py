"""Fan-out: many replays over many sandboxes — the manifest, the scheduler, resume, plans and reports."""
