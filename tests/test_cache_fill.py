"""The image cache filled by forked processes or by threads (`pipeline.data.cache_fill`): the
same tensors either way, the same first error, a child's death named, the choice logged, the
processes helping each other to the end."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline import forked
from pipeline.config import load_config
from pipeline.data import cache_fill
from pipeline.data.dataset import DetectionDataset, loader_for
from pipeline.data.sources import ImageRecord, SplitAnnotations
from pipeline.errors import DataError

SIZE = 32


@pytest.fixture(params=["processes", "threads"])
def fill_by(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Two workers of the kind named, whatever the split's size."""
    monkeypatch.setattr(
        cache_fill, "MIN_IMAGES_PER_PROCESS", 1 if request.param == "processes" else 10**9
    )
    return request.param


def _exif_rotated_jpeg(path: Path) -> tuple[int, int]:
    """A 48x24 JPEG shown turned by 90 degrees (EXIF orientation 6): 24x48 upright."""
    pixels = np.zeros((24, 48, 3), np.uint8)
    pixels[:16, :16] = 255
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(pixels).save(path, format="JPEG", quality=95, exif=exif.tobytes())
    return 24, 48


def _split(folder: Path, count: int = 12) -> SplitAnnotations:
    """Noise PNGs at input size, with a grayscale, a palette, an RGBA, an EXIF-rotated JPEG and
    a wide JPEG (letterboxed) among them: (width, height) and one box each."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    records = []
    for index in range(count):
        path = folder / f"{index:03d}.png"
        kind = index % 6
        if kind == 1:
            Image.fromarray(rng.integers(0, 256, (SIZE, SIZE), np.uint8), "L").save(path)
        elif kind == 2:
            palette = Image.fromarray(rng.integers(0, 4, (SIZE, SIZE), np.uint8), "P")
            palette.putpalette([0, 0, 0, 200, 30, 60, 10, 200, 90, 255, 255, 255])
            palette.save(path)
        elif kind == 3:
            Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 4), np.uint8), "RGBA").save(path)
        elif kind == 4:
            path = path.with_suffix(".jpg")
            _exif_rotated_jpeg(path)
        elif kind == 5:
            path = path.with_suffix(".jpg")
            wide = rng.integers(0, 256, (20, 50, 3), np.uint8)
            Image.fromarray(wide).save(path, quality=90)
        else:
            Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), np.uint8)).save(path)
        width, height = {4: (24, 48), 5: (50, 20)}.get(kind, (SIZE, SIZE))
        box = np.array([[1, 2, width - 3, height - 1]], np.float32)
        records.append(ImageRecord(index, path, width, height, box, np.array([0], np.int64)))
    return SplitAnnotations(records, ["thing"], folder / "instances.json")


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:60])


def test_processes_and_threads_fill_the_cache_with_the_samples_decoded_one_at_a_time(
    tmp_path: Path, two_torch_threads: None, fill_by: str
) -> None:
    split = _split(tmp_path)
    cached = DetectionDataset(split, SIZE)
    assert (cached.fill_plan.workers, cached.fill_plan.processes) == (2, fill_by == "processes")
    one_at_a_time = DetectionDataset(split, SIZE, cache=False)
    for index in range(len(split.records)):
        (image, target), (expected, wanted) = cached[index], one_at_a_time[index]
        assert torch.equal(image, expected), split.records[index].path.name
        for key in ("boxes", "ignore_boxes", "region"):
            assert torch.equal(target[key], wanted[key])
    assert not torch.equal(cached[0][0], cached[6][0])  # each image where it belongs


def test_processes_and_threads_name_the_first_bad_file_of_the_split_as_one_at_a_time_does(
    tmp_path: Path, two_torch_threads: None, fill_by: str
) -> None:
    split = _split(tmp_path)
    # one in each share: 2 (a palette PNG, first share) and 10 (second share)
    first, later = split.records[2].path, split.records[10].path
    _truncate(later)
    with pytest.raises(DataError) as only_later:
        DetectionDataset(split, SIZE)
    with pytest.raises(DataError) as alone:
        DetectionDataset(split, SIZE, cache=False)[10]
    assert str(only_later.value) == str(alone.value)
    assert str(later) in str(alone.value)
    _truncate(first)
    with pytest.raises(DataError) as both:
        DetectionDataset(split, SIZE)
    assert str(first) in str(both.value) and str(later) not in str(both.value)


def test_a_decoding_child_that_is_killed_is_named_with_its_images_not_waited_for(
    tmp_path: Path, two_torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cache_fill, "MIN_IMAGES_PER_PROCESS", 1)
    split = _split(tmp_path)
    parent = os.getpid()
    decode_into = DetectionDataset._decode_into

    def killed_in_child(self, index: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if os.getpid() != parent:  # as the kernel's out-of-memory killer would
            os.kill(os.getpid(), signal.SIGKILL)
        return decode_into(self, index, out)

    monkeypatch.setattr(DetectionDataset, "_decode_into", killed_in_child)
    with pytest.raises(DataError) as error:
        DetectionDataset(split, SIZE)
    message = str(error.value)
    assert "decoding images 6 to 11 into the image cache was killed (SIGKILL" in message
    assert "out of memory" in message and "data.cache: false" in message


def test_the_way_a_cached_split_is_decoded_is_logged_with_the_cache_decision(
    tmp_path: Path,
    two_torch_threads: None,
    fill_by: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    split = _split(tmp_path)
    config = load_config(None, ["data.cache=true", "data.num_workers=0"])
    config["data"]["image_size"] = SIZE
    with caplog.at_level(logging.INFO, logger="pipeline"):
        loader_for(split, config, train=False, pin_memory=False)
    [line] = [r.getMessage() for r in caplog.records if "decoded images" in r.getMessage()]
    assert "samples come from memory, decoded " in line
    way = "by 2 processes" if fill_by == "processes" else "on 2 threads (too few images"
    assert way in line


def test_the_cache_is_filled_by_processes_only_on_linux_with_enough_images_for_each() -> None:
    enough = 2 * cache_fill.MIN_IMAGES_PER_PROCESS
    assert cache_fill.plan(enough, threads=4, platform="linux") == cache_fill.FillPlan(
        2, True, "decoded by 2 processes (this one and forks)"
    )
    assert cache_fill.plan(enough - 1, threads=4, platform="linux").processes is False
    mac = cache_fill.plan(enough, threads=4, platform="darwin")
    assert (mac.workers, mac.processes) == (4, False) and "Linux only" in mac.reason
    alone = cache_fill.plan(enough, threads=1, platform="linux")
    assert alone == cache_fill.FillPlan(1, False, "decoded in this process (one CPU thread)")
    assert cache_fill.plan(1, threads=4, platform="linux").reason == "decoded in this process"


def test_forking_a_process_with_threads_warns_nobody(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.12+ warns at each fork of a process with threads (DeprecationWarning): the
    children's fork says why it is safe (forked.Child) instead of warning users."""
    real_fork = os.fork

    def fork_as_python_312_does() -> int:
        warnings.warn(
            f"This process (pid={os.getpid()}) is multi-threaded, use of fork() may lead to "
            "deadlocks in the child.",
            DeprecationWarning,
            stacklevel=2,
        )
        return real_fork()

    monkeypatch.setattr(os, "fork", fork_as_python_312_does)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert forked.Child(lambda: 42).outcome() == ("ok", 42)


def _fill_marking_who_decodes(
    count: int, slow_child: float, bad: set[int] = frozenset()
) -> tuple[torch.Tensor, ...]:
    """The cache of `count` 1-pixel images filled by this process and one child, each image
    1 where this process decoded it, 2 where the child did, which takes `slow_child` seconds
    an image (a CPU shared with other work); images in `bad` raise DataError naming them."""
    parent = os.getpid()

    def decode_into(index: int, out: torch.Tensor) -> None:
        if index in bad:
            raise DataError(f"image {index} is bad")
        if os.getpid() != parent:
            time.sleep(slow_child)
        out.numpy()[...] = 1 if os.getpid() == parent else 2

    return cache_fill.fill(count, 1, decode_into, cache_fill.FillPlan(2, True, "processes"))


@pytest.mark.skipif(sys.platform != "linux", reason="the cache is filled by forks on Linux only")
def test_a_process_that_has_finished_its_share_decodes_what_is_left_of_the_others() -> None:
    chunk = cache_fill.CHUNK_IMAGES
    images = _fill_marking_who_decodes(8 * chunk, slow_child=0.02)
    by = [int(image.sum()) // 3 for image in images]
    # the child's share is the second half: its first chunk its own, the rest this process's
    assert by == [1] * 4 * chunk + [2] * chunk + [1] * 3 * chunk


@pytest.mark.skipif(sys.platform != "linux", reason="the cache is filled by forks on Linux only")
def test_the_first_bad_image_is_raised_whichever_process_meets_it() -> None:
    chunk = cache_fill.CHUNK_IMAGES
    # this process meets 6 * chunk (in the child's share) before the child meets 4 * chunk + 1
    later, first = 6 * chunk, 4 * chunk + 1
    with pytest.raises(DataError, match=f"image {later} is bad"):
        _fill_marking_who_decodes(8 * chunk, slow_child=0.02, bad={later})
    with pytest.raises(DataError, match=f"image {first} is bad"):
        _fill_marking_who_decodes(8 * chunk, slow_child=0.02, bad={later, first})


@pytest.mark.skipif(sys.platform != "linux", reason="/proc shows whether a child is reaped")
def test_a_child_that_has_sent_its_result_is_reaped_all_the_same() -> None:
    child = forked.Child(lambda: 42)
    assert child.outcome() == ("ok", 42)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # a zombie keeps its /proc entry until it is reaped
    assert not Path(f"/proc/{child.pid}").exists()


@pytest.mark.skipif(sys.platform != "linux", reason="the cache is filled by forks on Linux only")
def test_a_bad_image_stops_the_other_process_at_its_next_chunk(tmp_path: Path) -> None:
    chunk = cache_fill.CHUNK_IMAGES
    parent, log = os.getpid(), tmp_path / "decoded_by_the_child"

    def decode_into(index: int, out: torch.Tensor) -> None:
        if index == 1:
            raise DataError("image 1 is bad")
        if os.getpid() != parent:
            time.sleep(0.02)
            with log.open("a") as file:
                file.write(f"{index}\n")

    with pytest.raises(DataError, match="image 1 is bad"):
        cache_fill.fill(8 * chunk, 1, decode_into, cache_fill.FillPlan(2, True, "processes"))
    # the child's share is 4 chunks and the rest of this process's 3 more: it stops within
    # the chunk it was decoding when this process met image 1
    decoded = log.read_text().split() if log.exists() else []
    assert len(decoded) <= chunk
