"""The forkserver's first import: the server dies with the process that started it.

`launching.workers` starts ranks from multiprocessing's forkserver, a process of its own that
imports torch (seconds) before it serves. Left alone it outlives a killed parent: it notices
the parent's end only when every holder of its "alive" pipe has closed it, and each rank it
forked holds one. So this module, imported first (the server's preload list), asks Linux to
kill the server with its parent (`rank.killed_with_parent`); the ranks, killed with the server
(`rank.ParentDeath`), follow. Elsewhere the pipe remains the only signal. Importing it anywhere
else would bind that process to its parent: only the forkserver imports it.
"""

from __future__ import annotations

from launching.rank import killed_with_parent

killed_with_parent()
