"""One attempt in one sandbox: stage the run directory, launch the hardened container, run it, collect
what it made, and record the outcome."""
