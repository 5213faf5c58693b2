"""One replay above the seam: its model gateway, and its attempts, retried in fresh sandboxes."""
