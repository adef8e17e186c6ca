"""Every default a user can change, each written once with its reason: the worker's
options (``options.WorkerOptions``), the ``Queue`` methods, the command line and the Django
backend's OPTIONS all read them here. (Limits that refuse bad input are in ``params.py``.)"""

from __future__ import annotations

# A claim's lease, in seconds: long enough that a healthy job is not taken over while its
# heartbeats (every LEASE / 3) are late, short enough that a crashed worker's job comes
# back within half a minute. The seed's value.
LEASE = 30.0

# Seconds between claims of an idle worker: LISTEN/NOTIFY wakes it at once when a job is
# enqueued, so polling only catches what a notification missed.
POLL_INTERVAL = 2.0

# Seconds between the reaper's rounds: a job whose lease ran out waits at most this long
# (after its lease) to come back.
REAP_INTERVAL = 5.0

# Jobs a lane claims at once: one, so a job waits on no other job's handler.
BATCH = 1

# The first retry's delay, in seconds; each further attempt doubles it (BACKOFF * 2^attempts).
BACKOFF = 1.0

# Attempts before a job goes dead (the schema's column default is the same number).
MAX_ATTEMPTS = 5

# Seconds a finished job's completion may wait to go out with others in one statement.
FLUSH_AFTER = 0.05
