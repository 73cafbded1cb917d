"""The shard file format: whole frames are read back exactly as appended, and nothing else is ever taken for one."""

from __future__ import annotations

import os

from hypothesis import given
from hypothesis import strategies as st

from walbuf.directory.frames import (
    ALIVE,
    CONFIG,
    HEAD_SIZE,
    MAX_BODY,
    RECORD,
    FrameReader,
    Unread,
    alive_frame,
    frame,
    json_frame,
    record_frame,
)

bodies = st.lists(st.tuples(st.sampled_from([RECORD, CONFIG, ALIVE]), st.binary(max_size=300)), max_size=12)


def read_all(path, offset=0, end=None):
    """What a reader reads: (kind, body) of each whole frame, and each Unread as it is; why it stopped; where."""
    fd = os.open(path, os.O_RDONLY)
    try:
        reader = FrameReader(fd, offset, end)
        frames = [item if isinstance(item, Unread) else (item.kind, item.body) for item in reader]
        return frames, reader.stop, reader.offset
    finally:
        os.close(fd)


@given(bodies, st.data())
def test_a_file_cut_anywhere_reads_back_exactly_the_whole_frames_before_the_cut(tmp_path_factory, frames, data):
    encoded = [frame(kind, body) for kind, body in frames]
    whole = b"".join(encoded)
    cut = data.draw(st.integers(0, len(whole)))
    path = tmp_path_factory.mktemp("cut") / "shard.log"
    path.write_bytes(whole[:cut])
    boundaries = [0]
    for e in encoded:
        boundaries.append(boundaries[-1] + len(e))
    whole_count = max(i for i, b in enumerate(boundaries) if b <= cut)
    read, stop, offset = read_all(path)
    assert read == frames[:whole_count]
    assert offset == boundaries[whole_count]
    assert stop == ("end" if cut == boundaries[whole_count] else "cut off")


@given(bodies.filter(lambda f: len(f) >= 2), st.data())
def test_a_changed_byte_makes_its_frame_unread_and_reading_goes_on_at_the_next_whole_frame(
    tmp_path_factory, frames, data
):
    encoded = [frame(kind, body) for kind, body in frames]
    hit = data.draw(st.integers(0, len(encoded) - 2))  # a frame with another after it
    at = data.draw(st.integers(0, len(encoded[hit]) - 1))
    changed = bytearray(encoded[hit])
    changed[at] ^= data.draw(st.integers(1, 255))
    path = tmp_path_factory.mktemp("damage") / "shard.log"
    path.write_bytes(b"".join(encoded[:hit]) + bytes(changed) + b"".join(encoded[hit + 1 :]))
    start = sum(len(e) for e in encoded[:hit])
    read, stop, offset = read_all(path)
    assert read == [*frames[:hit], Unread(start, start + len(encoded[hit])), *frames[hit + 1 :]]
    assert (stop, offset) == ("end", len(b"".join(encoded)))


@given(bodies.filter(lambda f: len(f) >= 3), st.data())
def test_a_range_read_again_yields_exactly_the_frames_it_holds_now(tmp_path_factory, frames, data):
    # A page a client cached stale, read right at the next sync.
    encoded = [frame(kind, body) for kind, body in frames]
    first = data.draw(st.integers(1, len(encoded) - 2))
    last = data.draw(st.integers(first, len(encoded) - 2))
    start, until = sum(len(e) for e in encoded[:first]), sum(len(e) for e in encoded[: last + 1])
    whole = b"".join(encoded)
    path = tmp_path_factory.mktemp("again") / "shard.log"
    path.write_bytes(whole[:start] + bytes(until - start) + whole[until:])
    read, _, _ = read_all(path)
    assert read == [*frames[:first], Unread(start, until), *frames[last + 1 :]]
    path.write_bytes(whole)
    assert read_all(path, start, until) == (frames[first : last + 1], "end", until)


def test_a_range_read_again_that_still_holds_no_whole_frame_is_unread_whole(tmp_path):
    first, second = record_frame(1, 0, 1.0, "{}"), record_frame(1, 1, 2.0, "{}")
    path = tmp_path / "shard.log"
    path.write_bytes(first + bytes(4096) + second)
    gap = Unread(len(first), len(first) + 4096)
    assert read_all(path)[0] == [(RECORD, first[HEAD_SIZE:]), gap, (RECORD, second[HEAD_SIZE:])]
    assert read_all(path, gap.start, gap.end) == ([gap], "end", gap.end)


def test_a_page_of_zeros_after_the_last_frame_is_a_cut_off_end_not_a_frame(tmp_path):
    # What a reader sees where a page it cached is older than the file's length.
    path = tmp_path / "shard.log"
    path.write_bytes(record_frame(1, 0, 1.0, "{}") + bytes(4096))
    read, stop, offset = read_all(path)
    assert [kind for kind, _ in read] == [RECORD]
    assert stop == "cut off" and offset == len(record_frame(1, 0, 1.0, "{}"))


def test_reading_resumes_from_an_offset_a_reader_reached_before(tmp_path):
    path = tmp_path / "shard.log"
    first = json_frame(CONFIG, {"a": 1})
    path.write_bytes(first)
    _, _, offset = read_all(path)
    with open(path, "ab") as f:
        f.write(alive_frame(2.5))
    read, stop, end = read_all(path, offset)
    assert read == [(ALIVE, alive_frame(2.5)[HEAD_SIZE:])] and stop == "end" and end == os.path.getsize(path)


def test_a_frame_declaring_a_body_over_the_limit_is_not_read(tmp_path):
    path = tmp_path / "shard.log"
    head = frame(RECORD, b"x")[:HEAD_SIZE]
    oversized = head[:4] + (MAX_BODY + 1).to_bytes(4, "little") + head[8:]
    path.write_bytes(oversized + b"x")
    read, stop, _ = read_all(path)
    assert read == [] and stop == "cut off"


def test_records_read_back_with_their_fields(tmp_path):
    path = tmp_path / "shard.log"
    path.write_bytes(record_frame(7, 2**63 - 1, 1.5, '{"loss":0.25,"name":"é"}'))
    fd = os.open(path, os.O_RDONLY)
    try:
        (read,) = list(FrameReader(fd))
    finally:
        os.close(fd)
    assert read.record() == (7, 2**63 - 1, 1.5, '{"loss":0.25,"name":"é"}')


def test_bytes_after_the_last_frame_that_cannot_start_one_are_damage_not_a_cut_off_end(tmp_path):
    path = tmp_path / "shard.log"
    path.write_bytes(alive_frame(1.0) + b"not a frame")
    read, stop, offset = read_all(path)
    assert [kind for kind, _ in read] == [ALIVE] and stop == "damaged" and offset == len(alive_frame(1.0))


def test_a_frame_whose_later_page_reached_the_file_before_its_first_is_a_cut_off_end_not_damage(tmp_path):
    # NFS write-back sends the pages of a write in parallel: another host may see the second before the first.
    first, big = alive_frame(1.0), record_frame(1, 0, 1.0, '{"x": "' + "y" * 6000 + '"}')
    path = tmp_path / "shard.log"
    path.write_bytes(first + bytes(4096) + big[4096:])
    read, stop, offset = read_all(path)
    assert [kind for kind, _ in read] == [ALIVE] and stop == "cut off" and offset == len(first)
