"""Where `densa cluster up` writes a new cluster secret and its logs: a directory of this user's
alone. The attack this closes: another local user creates the fixed default directory first,
with a symlink named `cluster-secret` pointing at a file of theirs, and reads the secret the
supervisor writes through it (and with it joins the internal plane).

The tests that need another user run where the suite runs as root (CI does): the other user is
`nobody` (uid 65534), whose processes plant the directory and files.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from densa.auth.secret import SECRET_ENV
from densa.cluster.config import RestartPolicy, parse_config
from densa.cluster.processes import ProcessSpec, SupervisedProcess, default_log_dir
from densa.utils.private_files import PrivateDirError, private_dir

NOBODY = 65534
POOLS = {"pools": [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"}]}
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


def as_nobody(*commands: str) -> None:
    """Run shell `commands` as the user nobody: the other local user of these tests."""
    script = " && ".join(commands)
    subprocess.run(["/bin/sh", "-c", script], user=NOBODY, group=NOBODY, check=True,
                   timeout=60, cwd="/")  # fmt: skip


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory every user may create entries in, as /tmp is (mode 1777), right under the
    system's temporary directory (pytest's own folders are closed to other users)."""
    shared = Path(tempfile.mkdtemp(prefix="densa-test-shared-"))
    os.chmod(shared, 0o1777)
    yield shared
    shutil.rmtree(shared)


def test_the_default_log_dir_is_this_users_own() -> None:
    assert default_log_dir() == Path(tempfile.gettempdir()) / f"densa-cluster-{os.geteuid()}"


def test_a_private_dir_is_made_0700_whatever_the_umask(tmp_path: Path) -> None:
    old_umask = os.umask(0)
    try:
        made = private_dir(tmp_path / "a" / "logs")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert private_dir(made) == made  # an existing one of ours is used as it is


@pytest.mark.parametrize("kind", ["symlink", "file", "group-writable", "world-writable"])
def test_a_dir_others_could_change_is_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "logs"
    if kind == "symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        path.symlink_to(tmp_path / "real")
    elif kind == "file":
        path.write_text("")
    else:
        path.mkdir()
        os.chmod(path, 0o770 if kind == "group-writable" else 0o777)
    with pytest.raises(PrivateDirError):
        private_dir(path)


@as_root
def test_a_log_dir_another_user_made_first_gets_no_secret(
    shared_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("ray")
    from densa.cluster.supervisor import Cluster

    log_dir, stolen = shared_tmp / "densa-cluster", shared_tmp / "stolen"
    as_nobody(f"mkdir -m 755 {log_dir}", f"touch {stolen}", f"chmod 644 {stolen}",
              f"ln -s {stolen} {log_dir / 'cluster-secret'}")  # fmt: skip
    assert log_dir.stat().st_uid == NOBODY
    monkeypatch.delenv(SECRET_ENV, raising=False)  # so the supervisor makes a new secret
    with pytest.raises(PrivateDirError, match=f"belongs to uid {NOBODY}"):
        Cluster(parse_config(POOLS), str(log_dir), say=print)
    assert stolen.read_text() == ""  # nothing was written through the planted symlink
    assert os.path.islink(log_dir / "cluster-secret")


@as_root
def test_a_planted_log_dir_stops_a_process_before_it_starts(shared_tmp: Path) -> None:
    log_dir = shared_tmp / "logs"
    as_nobody(f"mkdir -m 755 {log_dir}")
    spec = ProcessSpec("router", ("router", "--port", "{port}"), "127.0.0.1", log_dir=str(log_dir))
    process = SupervisedProcess(spec, RestartPolicy())
    with pytest.raises(PrivateDirError, match="belongs to uid"):
        process.start()
    assert process.status().pid is None and list(log_dir.iterdir()) == []


def test_a_secret_written_in_an_existing_private_dir_replaces_the_last_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("ray")
    from densa.cluster.supervisor import Cluster

    monkeypatch.delenv(SECRET_ENV, raising=False)
    first = Cluster(parse_config(POOLS), str(tmp_path / "logs"), say=print)
    second = Cluster(parse_config(POOLS), str(tmp_path / "logs"), say=print)
    assert first.secret != second.secret
    assert second.secret_path is not None
    assert second.secret_path.read_bytes().strip() == second.secret.value
    assert stat.S_IMODE(second.secret_path.stat().st_mode) == 0o600


def test_an_older_world_readable_log_is_made_private_when_opened_again(tmp_path: Path) -> None:
    """Logs an older densa wrote 0644 hold prompts' traces: reopened, they become 0600."""
    from densa.utils.private_files import open_private_log

    log = tmp_path / "worker.log"
    log.write_text("old\n")
    log.chmod(0o644)
    os.close(open_private_log(log))
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert log.read_text() == "old\n"  # appended to, never truncated
    if os.geteuid() == 0:  # another user's file is refused
        os.chown(log, 65534, 65534)
        with pytest.raises(PermissionError, match="another user"):
            open_private_log(log)
