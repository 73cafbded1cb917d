"""What walbuf trusts in a buffer (walbuf.store.trust): its owner's own files and folders, never a link.

Quick tests, no second account and no server: another account's file is
one chowned to an unused uid (the suite runs as root), as a co-tenant's
would be; the attacks themselves, by a real second account, are in
test_shared_storage.py.
"""

from __future__ import annotations

import os
import stat

import pytest

from walbuf.errors import BufferNotWritableError, UntrustedPathError
from walbuf.store.trust import Owner

OTHER_UID = 65534  # nobody: an account that is not this process's

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another account takes root")


@pytest.fixture
def me() -> Owner:
    return Owner(os.geteuid())


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_root_not_made_yet_belongs_to_this_process(tmp_path):
    assert Owner.of(tmp_path / "new.db", write=True) == Owner(os.geteuid())


def test_a_root_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "real.db").write_bytes(b"")
    (tmp_path / "link.db").symlink_to(tmp_path / "real.db")
    with pytest.raises(UntrustedPathError, match="symbolic link"):
        Owner.of(tmp_path / "link.db", write=False)


@pytest.mark.parametrize(("bits", "who"), [(0o020, "its group"), (0o002, "every account"), (0o022, "its group and")])
def test_a_root_others_may_write_is_refused_naming_who(tmp_path, bits, who):
    root = tmp_path / "buffer"
    root.mkdir(mode=0o700)
    os.chmod(root, 0o700 | bits)
    with pytest.raises(UntrustedPathError, match=who):
        Owner.of(root, write=False)


def test_a_root_passes_on_only_its_group_and_others_read_bits(tmp_path):
    root = tmp_path / "buffer"
    root.mkdir()
    os.chmod(root, 0o751)
    owner = Owner.of(root, write=True)
    assert owner.shared == 0o051
    assert (owner.folder_mode, owner.file_mode) == (0o751, 0o640)


@as_root
def test_another_accounts_buffer_is_read_but_never_written(tmp_path):
    root = tmp_path / "theirs.db"
    root.write_bytes(b"")
    os.chown(root, OTHER_UID, -1)
    assert Owner.of(root, write=False).uid == OTHER_UID
    with pytest.raises(BufferNotWritableError, match="belongs to"):
        Owner.of(root, write=True)


@as_root
def test_another_accounts_file_in_a_buffer_is_refused(tmp_path, me):
    planted = tmp_path / "planted"
    planted.write_bytes(b"")
    os.chown(planted, OTHER_UID, -1)
    with pytest.raises(UntrustedPathError, match="belongs to"):
        me.entry(planted)


def test_a_folder_where_a_file_belongs_is_refused(tmp_path, me):
    (tmp_path / "x").mkdir()
    with pytest.raises(UntrustedPathError, match="is not a file"):
        me.entry(tmp_path / "x")


def test_a_file_with_a_second_name_is_refused(tmp_path, me):
    (tmp_path / "a").write_bytes(b"")
    os.link(tmp_path / "a", tmp_path / "b")
    with pytest.raises(UntrustedPathError, match="2 names"):
        me.entry(tmp_path / "b")


def test_a_file_others_may_write_is_refused(tmp_path, me):
    (tmp_path / "a").write_bytes(b"")
    os.chmod(tmp_path / "a", 0o602)
    with pytest.raises(UntrustedPathError, match="every account"):
        me.entry(tmp_path / "a")


def test_a_missing_entry_is_none(tmp_path, me):
    assert me.entry(tmp_path / "none") is None


def test_a_sqlite_file_in_a_folder_others_may_write_is_refused(tmp_path, me):
    folder = tmp_path / "project"
    folder.mkdir()
    os.chmod(folder, 0o777)
    with pytest.raises(UntrustedPathError, match="every account"):
        me.shelter(folder, folder / "exp.db")


@as_root
def test_a_sqlite_file_in_another_accounts_folder_is_refused(tmp_path):
    owner = Owner(1000)  # a buffer of some account, in a folder that is neither its nor root's
    folder = tmp_path / "project"
    folder.mkdir(mode=0o755)
    os.chown(folder, OTHER_UID, -1)
    with pytest.raises(UntrustedPathError, match="who owns it"):
        owner.shelter(folder, folder / "exp.db")


def test_a_sqlite_file_in_a_private_folder_is_sheltered(tmp_path, me):
    folder = tmp_path / "mine"
    folder.mkdir(mode=0o700)
    me.shelter(folder, folder / "exp.db")  # nothing raised


def test_a_private_folder_is_made_owner_only_and_made_so_again_if_opened_up(tmp_path):
    sharing = Owner(os.geteuid(), shared=0o055, group=os.getegid())
    locks = tmp_path / "locks"
    assert sharing.folder(locks, make=True, private=True)
    assert mode(locks) == 0o700
    os.chmod(locks, 0o755)  # as `chmod -R go+rX` on the whole buffer would
    sharing.folder(locks, private=True)
    assert mode(locks) == 0o700


def test_a_folder_walbuf_makes_gets_the_roots_read_bits_whatever_the_umask(tmp_path):
    sharing = Owner(os.geteuid(), shared=0o050, group=os.getegid())
    old = os.umask(0o077)
    try:
        sharing.folder(tmp_path / "live", make=True)
    finally:
        os.umask(old)
    assert mode(tmp_path / "live") == 0o750


def test_a_missing_folder_is_not_made_unless_asked(tmp_path, me):
    assert not me.folder(tmp_path / "none")
    assert not (tmp_path / "none").exists()


def test_a_link_in_place_of_a_folder_is_refused(tmp_path, me):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "live").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UntrustedPathError, match="symbolic link"):
        me.folder(tmp_path / "live", make=True)


def test_a_file_is_never_opened_through_a_link(tmp_path, me):
    (tmp_path / "target").write_bytes(b"theirs")
    (tmp_path / "note").symlink_to(tmp_path / "target")
    with pytest.raises(UntrustedPathError, match="symbolic link"):
        me.open(tmp_path / "note", os.O_WRONLY, create=True)
    assert (tmp_path / "target").read_bytes() == b"theirs"


def test_a_file_walbuf_makes_is_owner_only_plus_the_roots_read_bits(tmp_path):
    sharing = Owner(os.geteuid(), shared=0o055, group=os.getegid())
    old = os.umask(0o077)
    try:
        os.close(sharing.open(tmp_path / "shared", os.O_WRONLY | os.O_EXCL, create=True))
        os.close(sharing.open(tmp_path / "private", os.O_WRONLY | os.O_EXCL, create=True, private=True))
    finally:
        os.umask(old)
    assert (mode(tmp_path / "shared"), mode(tmp_path / "private")) == (0o644, 0o600)


def test_a_missing_file_is_not_made_unless_asked(tmp_path, me):
    with pytest.raises(FileNotFoundError):
        me.open(tmp_path / "none", os.O_RDONLY)


def test_create_replaces_the_owners_file_and_never_writes_through_a_link(tmp_path, me):
    me.create(tmp_path / "note", b"first")
    me.create(tmp_path / "note", b"second")
    assert (tmp_path / "note").read_bytes() == b"second"
    (tmp_path / "target").write_bytes(b"theirs")
    (tmp_path / "linked").symlink_to(tmp_path / "target")
    with pytest.raises(UntrustedPathError):
        me.create(tmp_path / "linked", b"x")
    assert (tmp_path / "target").read_bytes() == b"theirs"


def test_read_gives_at_most_the_limit_and_none_for_a_missing_file(tmp_path, me):
    me.create(tmp_path / "note", b"0123456789")
    assert me.read(tmp_path / "note", 4) == b"0123"
    assert me.read(tmp_path / "none", 4) is None


OTHER_GID = 65534  # nogroup: a group that is not this process's


def test_a_root_made_here_passes_on_no_read_bits(tmp_path):
    owner = Owner.of(tmp_path / "new.db", write=True)
    assert (owner.folder_mode, owner.file_mode) == (0o700, 0o600)


@as_root
def test_what_walbuf_makes_in_a_root_shared_with_a_group_gets_that_group_but_lock_files_do_not(tmp_path):
    sharing = Owner(os.geteuid(), shared=0o050, group=OTHER_GID)
    sharing.folder(tmp_path / "live", make=True)
    os.close(sharing.open(tmp_path / "shard", os.O_WRONLY | os.O_EXCL, create=True))
    sharing.folder(tmp_path / "locks", make=True, private=True)
    os.close(sharing.open(tmp_path / "x.lock", os.O_WRONLY | os.O_EXCL, create=True, private=True))
    assert [os.lstat(tmp_path / n).st_gid for n in ("live", "shard")] == [OTHER_GID, OTHER_GID]
    assert [os.lstat(tmp_path / n).st_gid for n in ("locks", "x.lock")] == [os.getegid(), os.getegid()]
    assert {os.lstat(tmp_path / n).st_uid for n in ("live", "shard", "locks", "x.lock")} == {os.geteuid()}


def test_opening_a_file_walbuf_did_not_make_leaves_its_mode_alone(tmp_path, me):
    (tmp_path / "shard").write_bytes(b"")
    os.chmod(tmp_path / "shard", 0o640)
    os.close(me.open(tmp_path / "shard", os.O_RDONLY))
    os.close(me.open(tmp_path / "shard", os.O_WRONLY, create=True))  # there already: not made here
    assert mode(tmp_path / "shard") == 0o640


@as_root
def test_a_sqlite_file_in_a_private_folder_of_root_is_sheltered(tmp_path):
    folder = tmp_path / "scratch"
    folder.mkdir(mode=0o755)  # root's, as /scratch is
    Owner(1000).shelter(folder, folder / "exp.db")  # nothing raised


def test_missing_parents_are_made_owner_only_whatever_the_umask_and_existing_ones_left_alone(tmp_path):
    from walbuf.store.trust import make_folders

    os.chmod(tmp_path, 0o755)
    old = os.umask(0)
    try:
        make_folders(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert (mode(tmp_path), mode(tmp_path / "a"), mode(tmp_path / "a" / "b")) == (0o755, 0o700, 0o700)


def test_fsync_never_goes_through_a_link(tmp_path):
    from walbuf.store.trust import fsync

    (tmp_path / "file").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    fsync(tmp_path / "file")
    fsync(tmp_path, folder=True)
    with pytest.raises(OSError):
        fsync(tmp_path / "link")
    with pytest.raises(NotADirectoryError):
        fsync(tmp_path / "file", folder=True)
