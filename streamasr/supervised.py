"""What every service program does first under its supervisor."""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_parent() -> None:
    """Have the kernel send SIGTERM when the parent (supervisord) dies, so the program stops as
    on `streamasr stop` (the ingest drains, shm is unlinked). Killed outright, supervisord would
    otherwise leave its programs serving with no one to stop them: `status` and `stop` find no
    instance, and `serve` cannot bind its addresses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # Asked too late to be told: a supervisord killed while this program started (its imports
    # take seconds) is gone already, and the program is another's child now. SUPERVISOR_ENABLED
    # is what supervisord sets for its programs; one run by hand has no supervisord to lose.
    if os.environ.get("SUPERVISOR_ENABLED") and not _supervisord(os.getppid()):
        os.kill(os.getpid(), signal.SIGTERM)


def _supervisord(pid: int) -> bool:
    """The process is a supervisord: the program, or the script its interpreter runs."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2]
    except OSError:  # gone as well
        return False
    return any(Path(os.fsdecode(arg)).name == "supervisord" for arg in args)
