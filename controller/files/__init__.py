"""Files on the host: hashing, safe extraction of untrusted archives, tree snapshots, atomic writes.

Nothing here knows about Docker or pvisor; every stage that touches files uses these helpers.
"""
