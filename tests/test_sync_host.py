"""The sync host file of a directory buffer, on one machine: what names no host, and what a killed claim leaves.

Hosts are told apart here by WALBUF_HOST alone (tests/test_cluster_fs.py has
two hosts of two machines, on two mounts); WALBUF_LOCKS_SPAN_HOSTS=no makes
one host the only syncer of a buffer on this disk. A claim is killed from
outside, by strace, as it enters a syscall.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import require_strace

import walbuf
from walbuf.directory.layout import ENV_HOST, Layout
from walbuf.directory.mounts import ENV_LOCKS_SPAN
from walbuf.directory.sync_host import claim
from walbuf.errors import SyncHostError

CLAIM = "import sys; from pathlib import Path; from walbuf.directory import layout, sync_host;" + (
    " sync_host.claim(layout.Layout(Path(sys.argv[1])))"
)


@pytest.fixture
def layout(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_LOCKS_SPAN, "no")
    made = Layout(tmp_path / "buf")
    made.make()
    return made


def as_host(monkeypatch, host):
    monkeypatch.setenv(ENV_HOST, host)


def named_host(layout):
    return json.loads((layout.root / "sync-host").read_text())["host"]


def temporaries(layout):
    return sorted(layout.root.glob("sync-host.*.new"))


def killed_before_linking(layout, host):
    """A claim of ``host``, killed as it enters the link of its temporary to sync-host: the temporary is left."""
    strace = require_strace()
    kill = ["-e", "trace=link,linkat", "-e", "inject=link,linkat:signal=SIGKILL:when=1"]
    subprocess.run(
        [strace, "-f", "-qq", "-o", os.devnull, *kill, sys.executable, "-c", CLAIM, str(layout.root)],
        env={**os.environ, ENV_HOST: host},
        capture_output=True,
        timeout=120,
    )
    assert not (layout.root / "sync-host").exists()
    assert len(temporaries(layout)) == 1


def test_an_empty_sync_host_as_an_older_walbuf_leaves_while_it_names_itself_is_not_taken_over(layout, monkeypatch):
    (layout.root / "sync-host").write_bytes(b"")  # made, not yet written: that walbuf's host may go on to sync
    as_host(monkeypatch, "hostB")
    with pytest.raises(SyncHostError, match="names no host"):
        claim(layout)
    assert (layout.root / "sync-host").read_bytes() == b""


def test_a_sync_host_file_walbuf_did_not_write_is_not_taken_over(layout, monkeypatch):
    (layout.root / "sync-host").write_text('{"host": "hostA"')
    as_host(monkeypatch, "hostB")
    with pytest.raises(SyncHostError, match="names no host"):
        claim(layout)


def test_take_over_replaces_a_sync_host_file_that_names_no_host(layout, monkeypatch):
    (layout.root / "sync-host").write_bytes(b"")
    as_host(monkeypatch, "hostB")
    claim(layout, take_over=True)
    assert named_host(layout) == "hostB"
    assert temporaries(layout) == []


def test_the_first_claim_names_its_host_in_a_file_of_one_name(layout, monkeypatch):
    as_host(monkeypatch, "hostA")
    claim(layout)
    assert named_host(layout) == "hostA"
    assert os.stat(layout.root / "sync-host").st_nlink == 1 and temporaries(layout) == []


@pytest.mark.slow  # a process under strace
def test_a_temporary_left_by_a_claim_killed_before_linking_it_does_not_stop_another_hosts_claim(layout, monkeypatch):
    killed_before_linking(layout, "hostA")
    as_host(monkeypatch, "hostB")
    claim(layout)
    assert named_host(layout) == "hostB"


@pytest.mark.slow  # a process under strace
def test_the_next_claim_of_a_host_whose_claim_was_killed_removes_its_temporary(layout, monkeypatch):
    killed_before_linking(layout, "hostA")
    as_host(monkeypatch, "hostA")
    claim(layout)
    assert named_host(layout) == "hostA"
    assert temporaries(layout) == []


@pytest.mark.slow  # a process under strace
def test_a_temporary_of_another_host_is_left_to_it_and_not_listed_as_not_opened(layout, monkeypatch):
    killed_before_linking(layout, "hostA")
    (left,) = temporaries(layout)
    as_host(monkeypatch, "hostB")
    claim(layout)
    assert temporaries(layout) == [left]  # its host's claim may be under way: only that host removes it
    assert layout.strangers() == []  # its name is one walbuf gives: sync, status and doctor do not list it


def test_doctor_says_every_sync_is_refused_while_the_sync_host_file_names_no_host(layout):
    (layout.root / "sync-host").write_bytes(b"")
    (found,) = [f for f in walbuf.doctor(f"{layout.root}/").findings if f.check == "filesystem"]
    assert not found.ok and "names no host" in found.detail and "--take-over" in found.advice
