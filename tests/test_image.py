"""walbuf.Image: encoded once as PNG at log(), kept inside the record, sent as a wandb.Image.

Syncs run in this process against the session's fake server (``in_process``).
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest
import torch
from conftest import run_sync, walbuf_command
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import walbuf
from walbuf import Image, MetricTypeError, MetricValueError
from walbuf.directory.layout import ENV_HOST

pytestmark = pytest.mark.backends("sqlite")


def pixels(png: bytes) -> np.ndarray:
    with PIL.Image.open(io.BytesIO(png)) as image:
        return np.asarray(image)


def test_a_uint8_array_is_stored_as_a_png_of_the_same_pixels():
    array = np.random.default_rng(0).integers(0, 256, size=(5, 7, 3), dtype=np.uint8)
    image = Image(array, caption="sample")
    assert (image.width, image.height, image.caption) == (7, 5, "sample")
    assert (pixels(image.png) == array).all()


@pytest.mark.parametrize("shape", [(4, 6), (4, 6, 1), (4, 6, 3), (4, 6, 4)])
def test_grey_rgb_and_rgba_arrays_are_taken(shape):
    assert pixels(Image(np.full(shape, 9, dtype=np.uint8)).png).reshape(shape).tolist() == np.full(shape, 9).tolist()


@given(
    hnp.arrays(
        np.uint8,
        st.tuples(st.integers(1, 12), st.integers(1, 12), st.sampled_from([1, 3, 4])).map(
            lambda s: s if s[2] != 1 else s[:2]
        ),
    )
)
def test_every_uint8_image_comes_back_from_its_png_pixel_for_pixel(array):
    image = Image.from_json(Image(array).to_json())
    assert (image.height, image.width) == array.shape[:2] and (pixels(image.png) == array).all()


def test_floats_from_0_to_1_are_scaled_to_255():
    assert pixels(Image(np.array([[0.0, 0.5, 1.0]])).png).tolist() == [[0, 128, 255]]


@pytest.mark.parametrize(
    "array",
    [np.array([[1.5]]), np.array([[np.nan]]), np.array([[-1]]), np.array([[256]])],
    ids=["float over 1", "nan", "negative", "int over 255"],
)
def test_values_out_of_range_are_refused(array):
    with pytest.raises(MetricValueError, match="values from 0 to"):
        Image(array)


@pytest.mark.parametrize("shape", [(3,), (2, 2, 2), (2, 2, 3, 1), (0, 4)])
def test_a_shape_that_is_not_an_image_is_refused(shape):
    with pytest.raises(MetricValueError, match="shape"):
        Image(np.zeros(shape, dtype=np.uint8))


def test_a_torch_tensor_is_refused_saying_how_to_give_it():
    with pytest.raises(MetricTypeError, match="permute"):
        Image(torch.zeros(3, 4, 4))


def test_a_png_file_is_kept_byte_for_byte_and_other_formats_are_made_png(tmp_path):
    source = PIL.Image.fromarray(np.arange(48, dtype=np.uint8).reshape(6, 8))
    source.save(tmp_path / "a.png")
    source.save(tmp_path / "a.bmp")
    assert Image(tmp_path / "a.png").png == (tmp_path / "a.png").read_bytes()
    from_bmp = Image(str(tmp_path / "a.bmp"))
    assert from_bmp.png.startswith(b"\x89PNG") and (pixels(from_bmp.png) == np.asarray(source)).all()


def test_a_file_that_is_not_an_image_is_refused(tmp_path):
    (tmp_path / "notes.png").write_text("not an image")
    with pytest.raises(MetricValueError, match="cannot read"):
        Image(tmp_path / "notes.png")


def test_a_pil_image_of_a_mode_png_lacks_is_converted():
    assert Image(PIL.Image.new("CMYK", (3, 2))).png.startswith(b"\x89PNG")


def test_an_image_over_the_limit_is_refused_at_log_and_nothing_is_written(buffer):
    noise = np.random.default_rng(1).integers(0, 256, size=(1400, 1400, 3), dtype=np.uint8)  # ~5.9 MB of PNG
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        with pytest.raises(MetricValueError, match="over walbuf's limit"):
            w.log({"sample": Image(noise)})
    assert list(walbuf.read(buffer)) == []


def test_the_images_of_one_record_count_as_references_in_the_history_line(buffer):
    # Four images of ~3.2 MB: 17 MB in the record, far over W&B's 10 MB line, which holds only references.
    noise = np.random.default_rng(2).integers(0, 256, size=(1024, 1024, 3), dtype=np.uint8)
    image = Image(noise)
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        w.log({f"sample{i}": image for i in range(4)})
        with pytest.raises(MetricValueError, match="several calls"):
            w.log({f"sample{i}": image for i in range(12)})  # over walbuf's 32 MiB of images per record
    (record,) = walbuf.read(buffer)
    assert record.metrics["sample3"] == image


def test_a_logged_image_is_read_back_equal(buffer):
    image = Image(np.eye(8, dtype=np.uint8) * 255, caption="eye")
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        w.log({"sample": image, "loss": 0.5})
    (record,) = walbuf.read(buffer)
    assert record.metrics == {"sample": image, "loss": 0.5}


def test_a_value_marked_image_that_is_not_one_is_refused_and_nothing_written(buffer):
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        with pytest.raises(MetricValueError, match="marked an image"):
            w.log({"sample": {"_type": "walbuf-image", "png": "", "width": 0, "height": 1, "caption": None}})
    assert list(walbuf.read(buffer)) == []


def test_walbuf_records_prints_an_image_as_its_png_in_base64(buffer):
    image = Image(np.zeros((2, 3), dtype=np.uint8))
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        w.log({"sample": image})
    proc = walbuf_command("records", str(buffer))
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)["metrics"]["sample"]
    assert base64.b64decode(printed["png"]) == image.png and (printed["width"], printed["height"]) == (3, 2)


def synced_image(fake_run, key):
    """The image a history row refers to, as the server holds it: (the row's reference, the uploaded bytes)."""
    (row,) = [row for row in fake_run.history if key in row]
    reference = row[key]
    return reference, fake_run.files[reference["path"]]


def test_a_synced_image_is_uploaded_and_referenced_from_its_history_row(in_process, buffer):
    image = Image(np.random.default_rng(3).integers(0, 256, size=(16, 24, 3), dtype=np.uint8), caption="epoch 1")
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        w.log({"samples/val": image, "loss": 0.5})
    result = walbuf.sync(buffer)
    assert result.records == 1 and not result.runs[0].quarantined
    fake_run = in_process.run(result.runs[0].target.wandb_id)
    reference, uploaded = synced_image(fake_run, "w/samples/val")
    assert reference["_type"] == "image-file" and reference["caption"] == "epoch 1"
    assert (reference["width"], reference["height"]) == (24, 16)
    assert uploaded == image.png


def test_the_summary_refers_to_the_last_image_without_uploading_it_again(in_process, buffer):
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        w.log({"sample": Image(np.zeros((4, 4), dtype=np.uint8))})
        w.log({"sample": Image(np.ones((4, 4), dtype=np.uint8))})
    first = walbuf.sync(buffer)
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        w.log({"loss": 1.0})
    walbuf.sync(buffer)
    fake_run = in_process.run(first.runs[0].target.wandb_id)
    last_row = [row for row in fake_run.history if "w/sample" in row][-1]
    assert fake_run.summary["w/sample"]["path"] == last_row["w/sample"]["path"]
    assert sorted(name for name in fake_run.files if name.startswith("media/")) == sorted(
        row["w/sample"]["path"] for row in fake_run.history if "w/sample" in row
    )


def test_a_stored_image_pillow_cannot_read_is_quarantined_and_the_rest_arrive(in_process, buffer):
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        w.log({"loss": 1.0})
        # What an older walbuf, or a damaged disk, could leave: a PNG header over garbage.
        w.log(
            {
                "sample": Image.from_png(
                    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x02\x00\x00\x00\x02" + b"x" * 40
                )
            }
        )
        w.log({"loss": 0.5})
    result = walbuf.sync(buffer)
    (quarantined,) = result.runs[0].quarantined
    assert quarantined.step == 1 and "cannot be read" in quarantined.reason
    fake_run = in_process.run(result.runs[0].target.wandb_id)
    assert [row["w/loss"] for row in fake_run.history if "w/loss" in row] == [1.0, 0.5]


def test_a_record_with_an_unreadable_image_leaves_no_file_of_its_readable_one(in_process, buffer, tmp_path):
    readable = Image(np.full((3, 5), 7, dtype=np.uint8))
    unreadable = Image.from_png(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x02\x00\x00\x00\x02" + b"x" * 40)
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        w.log({"a": readable, "b": unreadable})
    result = walbuf.sync(buffer, mode="offline", directory=tmp_path / "out")
    assert len(result.runs[0].quarantined) == 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["wandb"]  # the working folder is gone


@pytest.mark.slow
def test_an_image_logged_into_a_directory_buffer_arrives_from_a_sync_on_another_host(server, tmp_path):
    directory = str(tmp_path / "buf") + "/"
    image = Image(np.random.default_rng(4).integers(0, 256, size=(8, 8, 3), dtype=np.uint8))
    proc = subprocess.run(
        [sys.executable, "-c", WRITE_ON_A_NODE, directory, base64.b64encode(image.png).decode()],
        env={**os.environ, ENV_HOST: "node1"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert run_sync(server, directory, env={ENV_HOST: "login"}).returncode == 0
    (fake_run,) = server.runs.values()
    reference, uploaded = synced_image(fake_run, "w/sample")
    assert uploaded == image.png


WRITE_ON_A_NODE = """
import base64, sys, walbuf
with walbuf.Writer(sys.argv[1], writer="w", run="exp") as w:
    w.log({"sample": walbuf.Image.from_png(base64.b64decode(sys.argv[2]))})
"""


@pytest.mark.slow
def test_an_image_synced_offline_is_in_the_run_directory_and_wandb_sync_uploads_it(server, buffer, tmp_path):
    image = Image(np.full((3, 5), 7, dtype=np.uint8))
    with walbuf.Writer(buffer, writer="w", run="r", run_id="offline1") as w:
        w.log({"sample": image})
    proc = run_sync(server, buffer, "--mode", "offline", "--dir", str(tmp_path / "out"), quiet=False)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["wandb"]  # no image file left behind
    command = next(line for line in proc.stdout.splitlines() if "wandb sync" in line).split("with: ", 1)[1]
    env = {k: v for k, v in {**os.environ, **server.env()}.items() if k != "WANDB_SERVICE"}
    assert subprocess.run(command.split(), capture_output=True, text=True, env=env).returncode == 0
    reference, uploaded = synced_image(server.run("offline1"), "w/sample")
    assert uploaded == image.png


def test_a_caption_holding_a_nul_is_refused_where_it_is_made_and_where_it_is_stored(buffer):
    with pytest.raises(MetricValueError, match="NUL"):
        Image(np.zeros((2, 2), dtype=np.uint8), caption="a\x00b")
    stored = Image(np.zeros((2, 2), dtype=np.uint8)).to_json() | {"caption": "a\x00b"}
    with walbuf.Writer(buffer, writer="w") as w:
        with pytest.raises(MetricValueError, match="without a NUL"):
            w.log({"sample": stored})
    assert list(walbuf.read(buffer)) == []
