"""For the saver scripts of the tests: kill this process right before its N-th filesystem operation, to land a kill
at every boundary between two steps of a save protocol (deterministically, unlike a kill at a random instant)."""

import os
import shutil
import signal

FS_OPERATIONS = [
    (os, "link"),
    (os, "replace"),
    (os, "rename"),
    (os, "remove"),
    (os, "unlink"),
    (os, "rmdir"),
    (os, "fsync"),
    (os, "makedirs"),
    (os, "mkdir"),
    (shutil, "rmtree"),
]


def die_before_operation(number: int) -> None:
    """From now on, SIGKILL this process right before its `number`-th filesystem operation (0-based)."""
    count = [0]
    for module, name in FS_OPERATIONS:
        original = getattr(module, name)

        def hooked(*args, _original=original, **kwargs):
            if count[0] == number:
                os.kill(os.getpid(), signal.SIGKILL)
            count[0] += 1
            return _original(*args, **kwargs)

        setattr(module, name, hooked)
