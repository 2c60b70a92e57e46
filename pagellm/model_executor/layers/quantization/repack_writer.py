"""Writes a load's repacked GGUF groups to the repack cache (quantization/gguf.py's
RepackCache), in a process of its own: the engine that made them goes on (or exits) while
gigabytes reach the disk at its pace.

Run by path (no package import): `python repack_writer.py` with a JSON job on stdin,
{"fd": the memfd holding the groups at their offsets, "directory", "build", "format",
"entries", "bytes"}. One writer per directory at a time (a lock file; a second leaves it
to the first); the data file first, then the index naming it, then the other data files
removed (a process mapping one keeps its pages)."""

import contextlib
import fcntl
import json
import os
import shutil
import sys
import time


def write(job: dict) -> None:
    directory = job["directory"]
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "repacked.lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # another process is writing this cache
        if shutil.disk_usage(directory).free < job["bytes"] + (1 << 30):
            return  # the disk's last GB stays the user's
        if _written(directory, job):
            return  # another process wrote the same groups since this one looked
        name = f"repacked-{os.getpid()}-{time.time_ns()}.bin"
        data, tmp = os.path.join(directory, name), os.path.join(directory, f"repacked.json.tmp-{os.getpid()}")
        try:
            with open(data, "wb") as out:
                offset, end = 0, job["bytes"]
                while offset < end:
                    sent = os.sendfile(out.fileno(), job["fd"], offset, min(end - offset, 1 << 30))
                    if sent <= 0:
                        raise OSError("the repacked groups ended early")
                    offset += sent
                os.fsync(out.fileno())  # on disk before an index names it
            with open(tmp, "w") as f:
                json.dump({"format": job["format"], "build": job["build"], "file": name,
                           "entries": job["entries"]}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(directory, "repacked.json"))  # the one switch
        except BaseException:
            for path in (data, tmp):  # a full disk keeps nothing half written
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise
        for old in os.listdir(directory):  # every other data file: none is being written
            # (the lock), and the index names none of them any more
            if old.startswith("repacked-") and old.endswith(".bin") and old != name:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, old))


def _written(directory: str, job: dict) -> bool:
    """Whether the index there already names a file of the same groups."""
    try:
        with open(os.path.join(directory, "repacked.json")) as f:
            index = json.load(f)
        same = [{k: e.get(k) for k in ("source", "type", "shape")} for e in index["entries"]]
        return (index["build"] == job["build"] and index["format"] == job["format"]
                and os.path.isfile(os.path.join(directory, index["file"]))
                and same == [{k: e[k] for k in ("source", "type", "shape")} for e in job["entries"]])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


if __name__ == "__main__":
    write(json.load(sys.stdin))
