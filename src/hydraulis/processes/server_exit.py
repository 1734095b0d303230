"""Imported by the rank fork server alone (the last of `rank_server.PRELOAD`): when its launcher ends, the server
leaves without tearing down torch and the modules it preloaded.

Why: the server holds the launcher's stdout and stderr, so whoever reads them (a pipe, `| tee`, a test's
`subprocess.run`) waits for it to exit; its teardown took 1.3-1.7 s after every `hydraulis train` on 2 cores
(measured 2026-12-07), and nothing in it needs finalizing: it only forks ranks, which end with `os._exit`
themselves (`launch._child`). Registered last, the exit runs first of its atexit functions.
"""

import atexit

from hydraulis.processes.leave import leave

atexit.register(leave, 0)
