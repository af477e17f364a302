"""Filling a split's image cache, one [N,3,S,S] uint8 tensor, from its image files: in forked
processes on Linux, else on threads, each a contiguous share of the images (a task per image
would cost a hand-over per image, more than a small image's decoding). A process that has
finished its share helps with what is left of the others', a chunk at a time, so the
processes end together however fast each runs (a CPU shared with other work, this one's
boxes).

Processes, not threads, where they are safe: decoding a small image is mostly Python around
a short stretch of C, so threads spend about what they win on handing the GIL over, while
each process decodes with an interpreter of its own. Forked, not spawned nor from a
forkserver: a fork starts with every module the parent imported and the split's records,
where a new interpreter would first import them (torch, for a letterboxed image's resize);
a fork is unsafe on macOS (its system libraries) and absent on Windows, so threads there.
The children write into an anonymous shared mapping (MAP_SHARED|MAP_ANONYMOUS), which
lives in no file system: not /dev/shm either, whose size containers often cap far below a
large cache. The boxes are no business of theirs: they come from the annotations.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
from array import array
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from itertools import chain, pairwise

import torch

from pipeline import forked
from pipeline.data.cache import decoded_bytes, size_text
from pipeline.errors import DataError, PipelineError

# The fewest images for which a process of its own pays for its fork and its first touches
# of the memory it shares with this process (its end is not waited for): measured against
# threads on the synthetic shapes' 128 px PNGs (the cheapest images to decode there are), as
# the share from which processes took less time, the shares balanced as `_Chunks` does.
MIN_IMAGES_PER_PROCESS = 128

# Images a process decodes between two looks at what is left: the processes end within a
# chunk's decoding of each other, and one read of a pipe per chunk costs nothing that shows.
CHUNK_IMAGES = 8
# a share's chunks at most: their starts, 4 bytes each, must fit in an empty pipe's buffer
# (one page where a user's pipes are limited) for writing them never to block
_MAX_CHUNKS = 1024

DecodeInto = Callable[[int, torch.Tensor], object]


@dataclass(frozen=True)
class FillPlan:
    workers: int  # processes (this one and forked children) or threads, each a share
    processes: bool
    reason: str  # how the images are decoded, and why, for the split's log line


def plan(count: int, threads: int | None = None, platform: str | None = None) -> FillPlan:
    """As many workers as torch may use threads (`cpu_threads`): processes where fork is safe
    (`forked.safe` on `platform`, default this one) and each gets enough images to pay for its
    start, else threads."""
    threads = torch.get_num_threads() if threads is None else threads
    if threads <= 1 or count <= 1:
        return FillPlan(
            1, False, "decoded in this process" + (" (one CPU thread)" if threads <= 1 else "")
        )
    workers = min(threads, count)
    if not forked.safe(platform):
        return FillPlan(
            workers, False, f"decoded on {workers} threads (processes are forked on Linux only)"
        )
    processes = min(workers, count // MIN_IMAGES_PER_PROCESS)
    if processes < 2:
        return FillPlan(
            workers,
            False,
            f"decoded on {workers} threads (too few images for processes: "
            f"{MIN_IMAGES_PER_PROCESS} or more each)",
        )
    return FillPlan(processes, True, f"decoded by {processes} processes (this one and forks)")


def fill(
    count: int,
    image_size: int,
    decode_into: DecodeInto,
    how: FillPlan,
    meanwhile: Callable[[], None] = lambda: None,
) -> tuple[torch.Tensor, ...]:
    """The cache: its images in order, each a view of one [N,3,S,S] tensor, image i written by
    `decode_into(i, its view)`; `meanwhile()` runs here while other workers decode (work that
    needs no pixels, such as the boxes).

    The first bad image's error, as decoding one at a time gives it: each worker stops at its
    first bad image, and the lowest of those is raised.
    """
    shape = (count, 3, image_size, image_size)
    if how.processes:
        shared = mmap.mmap(-1, decoded_bytes(count, image_size))  # freed with its last view
        images = torch.frombuffer(shared, dtype=torch.uint8).view(shape)
    else:
        images = torch.empty(shape, dtype=torch.uint8)
    views = images.unbind(0)  # a view per image in one call: indexing per image costs more
    bounds = [count * share // how.workers for share in range(how.workers + 1)]

    def decode_one(index: int) -> None:
        decode_into(index, views[index])

    def decode_share(share: int) -> None:
        for index in range(bounds[share], bounds[share + 1]):
            decode_one(index)

    if how.processes:
        _in_processes(decode_one, bounds, meanwhile, size_text(images.numel()))
    elif how.workers == 1:
        decode_share(0)
        meanwhile()
    else:
        with ThreadPoolExecutor(how.workers, thread_name_prefix="decode") as pool:
            shares = pool.map(decode_share, range(how.workers))
            meanwhile()
            list(shares)  # raises the first share's error
    return views


def _in_processes(
    decode_one: Callable[[int], object],
    bounds: list[int],
    meanwhile: Callable[[], None],
    size: str,
) -> None:
    """`meanwhile()` here, then share 0, each other share in a child forked from this process;
    then each helps with what is left of the others' (`_Chunks`). The first bad image's
    error, as one at a time gives it: each stops at its first, and the lowest is raised."""
    chunks = _Chunks(bounds)

    def in_child(share: int) -> tuple[int, PipelineError] | None:
        torch.set_num_threads(1)  # a resize must not start OpenMP workers: see forked.Child
        return chunks.decode(share, decode_one)

    children: list[forked.Child] = []
    try:
        for share in range(1, len(bounds) - 1):
            children.append(forked.Child(partial(in_child, share)))
        meanwhile()  # first: what is left of its share at the end is the children's to take
        found = [chunks.decode(0, decode_one)]
        outcomes = [child.outcome() for child in children]
    except BaseException:
        for child in children:
            child.kill()
        raise
    finally:
        chunks.close()
    for share, (kind, value) in enumerate(outcomes, start=1):
        first, last = bounds[share], bounds[share + 1] - 1
        if kind == "died":
            raise DataError(
                f"The process decoding images {first} to {last} into the image cache "
                f"{_ended(value)} before it finished; the cache needs {size} of memory: free "
                "some, or set data.cache: false."
            )
        if kind != "ok":
            raise RuntimeError(f"Decoding images {first} to {last} failed in a child:\n{value}")
        found.append(value)
    bad = min((each for each in found if each is not None), key=lambda each: each[0], default=None)
    if bad is not None:
        raise bad[1]


class _Chunks:
    """Each share's images in chunks: its first chunk is its own worker's, the starts of the
    others wait in a pipe of the share's, written before the fork and closed for writing.
    Every worker reads its own share's pipe, then the others' (`left_by`), till they read as
    empty: the kernel serialises a pipe's reads, so each start is read by one worker only.
    Each share's first chunk is never handed out: each worker has images of its own.

    A worker that meets a bad image says so, in memory the workers share (a slot each, one
    writer each): the others decode no chunk that starts past the lowest such image, whose
    error would not be the first, so a bad file fails the fill about as soon as the images
    before it are decoded, not after all of them."""

    def __init__(self, bounds: list[int]) -> None:
        self.bounds = bounds
        longest = max(stop - start for start, stop in pairwise(bounds))
        self.size = max(CHUNK_IMAGES, -(-longest // _MAX_CHUNKS))
        self._first_bad = memoryview(mmap.mmap(-1, 8 * (len(bounds) - 1))).cast("q")
        self._first_bad[:] = array("q", [bounds[-1]] * (len(bounds) - 1))  # none yet
        self._pipes: list[int] = []
        try:
            for start, stop in pairwise(bounds):
                read_end, write_end = os.pipe()
                self._pipes.append(read_end)
                starts = range(start + self.size, stop, self.size)
                try:
                    os.write(write_end, struct.pack(f"<{len(starts)}I", *starts))
                finally:
                    os.close(write_end)
        except BaseException:
            self.close()
            raise

    def decode(
        self, share: int, decode_one: Callable[[int], object]
    ) -> tuple[int, PipelineError] | None:
        """The share's chunks, then what is left of the others', decoded in order up to the
        first bad image: its index and error, told the other workers."""
        for chunk in chain(self.of_share(share), self.left_by(share)):
            for index in chunk:
                try:
                    decode_one(index)
                except PipelineError as error:
                    self._first_bad[share] = index
                    return index, error
        return None

    def of_share(self, share: int) -> Iterator[range]:
        """The share's first chunk, then those its pipe still holds."""
        start, stop = self.bounds[share], self.bounds[share + 1]
        if start < min(self._first_bad):
            yield range(start, min(start + self.size, stop))
        yield from self._handed_out(share)

    def left_by(self, share: int) -> Iterator[range]:
        """The chunks still in the other shares' pipes, the next shares' first."""
        count = len(self._pipes)
        for step in range(1, count):
            yield from self._handed_out((share + step) % count)

    def _handed_out(self, share: int) -> Iterator[range]:
        stop = self.bounds[share + 1]
        while token := os.read(self._pipes[share], 4):
            (start,) = struct.unpack("<I", token)
            if start >= min(self._first_bad):  # and so are the pipe's next ones
                return
            yield range(start, min(start + self.size, stop))

    def close(self) -> None:
        for pipe in self._pipes:
            os.close(pipe)
        self._pipes = []


def _ended(code: int) -> str:
    if code >= 0:
        return f"ended with status {code}"
    name = signal.Signals(-code).name
    if -code == signal.SIGKILL:
        return f"was killed ({name}: most often by the kernel, out of memory)"
    return f"was killed ({name})"
