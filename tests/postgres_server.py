"""A throwaway PostgreSQL cluster for tests: `initdb` + `pg_ctl` in a temp dir, trust auth on 127.0.0.1 and a free
port, stopped and removed on exit. As root (CI) the cluster runs as the `postgres` user, since PostgreSQL refuses
to run as root. `.ci/run` installs Debian's postgresql."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from redis_server import free_port


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


INITDB, PG_CTL = _pg_bin("initdb"), _pg_bin("pg_ctl")


def _runner() -> list[str] | None:
    """The command prefix that runs a server binary as a non-root user; None when none can."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return None
    return ["runuser", "-u", "postgres", "--"] if shutil.which("runuser") else None


def unavailable() -> str | None:
    """Why no cluster can be started here, or None."""
    if INITDB is None or PG_CTL is None:
        return "PostgreSQL is not installed (.ci/run installs it)"
    if _runner() is None:
        return "running as root without a `postgres` user to run the server as"
    return None


@contextmanager
def postgres_server() -> Iterator[str]:
    """Starts a cluster and yields its URL (database `postgres`, user `glmserve`)."""
    prefix = _runner()
    assert INITDB and PG_CTL and prefix is not None, unavailable()
    root = Path(tempfile.mkdtemp(prefix="glmserve-pg-"))
    if prefix:
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
    data, port = root / "data", free_port()
    try:
        subprocess.run([*prefix, INITDB, "-D", str(data), "-U", "glmserve", "--auth=trust", "-E", "UTF8"],
                       check=True, capture_output=True)
        subprocess.run([*prefix, PG_CTL, "-D", str(data), "-l", str(root / "log"), "-w", "-t", "60", "-o",
                        f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start"],
                       check=True, capture_output=True)
        yield f"postgresql://glmserve@127.0.0.1:{port}/postgres"
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([*prefix, PG_CTL, "-D", str(data), "-m", "immediate", "-w", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
