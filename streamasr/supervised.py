"""What every service program does first under its supervisor."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
SUPERVISORD_PID = "STREAMASR_SUPERVISORD_PID"  # set by `serve` for the programs of the supervisord it becomes


def end_with_parent() -> None:
    """Have the kernel send SIGTERM when the parent (supervisord) dies, so the program stops as
    on `streamasr stop` (the ingest drains, shm is unlinked). Killed outright, supervisord would
    otherwise leave its programs serving with no one to stop them: `status` and `stop` find no
    instance, and `serve` cannot bind its addresses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # Asked too late to be told: a supervisord killed while this program started (its imports
    # take seconds) is gone already, and the program is another's child now. `serve` names the
    # supervisord it becomes; a program started otherwise (by hand) has only the kernel's word.
    parent = os.environ.get(SUPERVISORD_PID)
    if parent and os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)
