"""walbuf's own file locks (walbuf.store.flock): exclusive, owner-only, never through a link, with a note for later."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from walbuf.errors import UntrustedPathError
from walbuf.store.flock import NOTE_WIDTH, FileLock, held, read_note
from walbuf.store.trust import Owner


@pytest.fixture
def me() -> Owner:
    return Owner(os.geteuid())


def test_a_held_lock_is_not_taken_by_another_holder_until_it_is_released(tmp_path, me):
    first, second = FileLock(tmp_path / "x.lock", me), FileLock(tmp_path / "x.lock", me)
    assert first.acquire(timeout=0)
    assert not second.acquire(timeout=0)
    assert held(tmp_path / "x.lock", me)
    first.release()
    assert not held(tmp_path / "x.lock", me)
    assert second.acquire(timeout=0)
    second.release()


def test_a_lock_file_is_made_owner_only_even_in_a_buffer_shared_for_reading(tmp_path):
    sharing = Owner(os.geteuid(), shared=0o055, group=os.getegid())  # the root grants group and others read access
    lock = FileLock(tmp_path / "x.lock", sharing)
    assert lock.acquire(timeout=0)
    lock.release()
    assert os.stat(tmp_path / "x.lock").st_mode & 0o777 == 0o600


def test_a_note_reads_back_whole_and_each_note_replaces_the_last_in_place(tmp_path, me):
    path = tmp_path / "x.lock"
    lock = FileLock(path, me)
    assert lock.acquire(timeout=0)
    lock.note("open")
    lock.note("closed 0 12")
    assert lock.current_note() == "closed 0 12"
    lock.release()
    assert read_note(path, me) == "closed 0 12"
    assert path.stat().st_size == NOTE_WIDTH  # written over the same bytes: no room needed on a full disk


@pytest.mark.parametrize("content", [b"", b"closed 0 1", b"x" * NOTE_WIDTH])
def test_what_is_not_a_whole_note_reads_as_none(tmp_path, me, content):
    path = tmp_path / "x.lock"
    path.write_bytes(content)
    path.chmod(0o600)
    assert read_note(path, me) is None


def test_a_link_in_place_of_a_lock_file_is_refused_and_its_target_left_alone(tmp_path, me):
    target = tmp_path / "precious"
    target.write_text("keep me")
    link = tmp_path / "x.lock"
    link.symlink_to(target)
    with pytest.raises(UntrustedPathError):
        FileLock(link, me).acquire(timeout=0)
    with pytest.raises(UntrustedPathError):
        held(link, me)
    assert target.read_text() == "keep me"


def test_a_lock_file_with_a_second_name_is_refused(tmp_path, me):
    path = tmp_path / "x.lock"
    path.write_bytes(b"")
    path.chmod(0o600)
    os.link(path, tmp_path / "elsewhere")
    with pytest.raises(UntrustedPathError):
        FileLock(path, me).acquire(timeout=0)


def test_a_missing_lock_file_is_not_held_and_probing_it_makes_none(tmp_path: Path, me):
    assert not held(tmp_path / "x.lock", me)
    assert read_note(tmp_path / "x.lock", me) is None
    assert not (tmp_path / "x.lock").exists()


# A process started with its standard input closed (a daemon, a cron line with
# `<&-`) opens its first file as descriptor 0: a lock on it is a lock like any other.
ON_DESCRIPTOR_0 = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from walbuf.store.flock import FileLock, held, read_note
    from walbuf.store.trust import Owner

    os.close(0)
    me, path = Owner(os.geteuid()), Path(sys.argv[1])
    lock = FileLock(path, me)
    assert lock.acquire(timeout=0)
    assert os.fstat(0).st_ino == path.stat().st_ino, "the lock file is not on descriptor 0"
    try:
        lock.acquire(timeout=0)
    except RuntimeError:
        pass
    else:
        raise AssertionError("a held lock was taken again")
    lock.note("closed 0 7")
    assert lock.current_note() == "closed 0 7"
    assert held(path, me)
    lock.release()
    assert not held(path, me) and read_note(path, me) == "closed 0 7"
    print("ok")
    """
)


def test_a_lock_on_descriptor_0_is_held_noted_and_released_as_any_other(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", ON_DESCRIPTOR_0, str(tmp_path / "x.lock")], capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr
