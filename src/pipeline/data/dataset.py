"""Images and boxes as tensors at the model's input size, with seeded augmentation.

Any image mode (grayscale, RGBA, palette) becomes RGB, turned upright by its EXIF
orientation; any size is letterboxed (or stretched) to a square input with
`torchvision.transforms.v2`, boxes and ignore regions transformed with it.
Augmentation draws from an RNG seeded by (seed, epoch, index), never from global state,
so a resumed run sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from pipeline.data import cache as image_cache
from pipeline.data import cache_fill
from pipeline.data.geometry import PAD_VALUE, RESIZE_MODES, Geometry, fit_boxes, fit_image
from pipeline.data.orientation import upright
from pipeline.data.sources import (
    NOT_AN_IMAGE,
    TOO_LARGE,
    ImageRecord,
    SplitAnnotations,
    check_image_files,
)
from pipeline.errors import DataError

if TYPE_CHECKING:
    from torchvision.transforms import v2

log = logging.getLogger("pipeline")


# RandomPhotometricDistort's ranges, without its channel permutation (data.augment.channel_shuffle
# says whether colour may change the class) and without hue: on a CPU a hue shift costs more
# than the rest of the augmentation together, for a change of at most 5% of the colour circle.
PHOTOMETRIC = {"brightness": (0.875, 1.125), "contrast": (0.5, 1.5), "saturation": (0.5, 1.5)}


@dataclass(frozen=True)
class Augment:
    """Label-preserving training augmentation (config `data.augment`)."""

    hflip: float = 0.5
    vflip: float = 0.0
    transpose: float = 0.0
    channel_shuffle: float = 0.0
    min_box_size: float = 2.0
    scale_min: float = 1.0
    scale_max: float = 1.0
    photometric: float = 0.0

    @property
    def scales(self) -> bool:
        return (self.scale_min, self.scale_max) != (1.0, 1.0)

    @property
    def enabled(self) -> bool:
        flips = any((self.hflip, self.vflip, self.transpose, self.channel_shuffle))
        return flips or self.scales or self.photometric > 0

    def library_transforms(self, size: int) -> v2.Compose | None:
        """Scale jitter and colour distortion from torchvision (they draw from torch's RNG).
        torchvision is imported here and where they run, not with this module: it imports
        torch's compiler, seconds at the start of every command that loads data."""
        from torchvision.transforms import v2

        steps: list[v2.Transform] = []
        if self.scales:
            steps += [
                v2.ScaleJitter((size, size), (self.scale_min, self.scale_max)),
                v2.RandomCrop((size, size), pad_if_needed=True, fill=PAD_VALUE),
            ]
        if self.photometric > 0:
            steps.append(v2.RandomApply([v2.ColorJitter(**PHOTOMETRIC)], p=self.photometric))
        return v2.Compose(steps) if steps else None


def _eight_bit_grey(img: Image.Image, path: os.PathLike | str, sixteen_bit: bool) -> Image.Image:
    """A 16-bit greyscale image (microscopy, medical, depth) as 8 bits: the top 8 of the bits
    its values use. A 12-bit camera's values stored in 16 bits are read by bits 4-11, not by a
    high byte of at most 15 (nearly black), and 8-bit values stored in 16 bits as they are;
    values that use all 16 bits by their high byte, as Pillow reduces a 16-bit colour PNG.
    Pillow's own conversion of greyscale clips every value above 255 to white. Other 32-bit
    integers within 0-255 are 8-bit values; beyond, and floats, have no brightness scale of
    their own, so they are refused, never clipped to white or black."""
    values = np.asarray(img)
    if sixteen_bit:
        used = int(values.max()).bit_length() if values.size else 0
        return Image.fromarray((values.astype(np.uint16) >> max(used - 8, 0)).astype(np.uint8))
    if img.mode == "I" and (values.size == 0 or (values.min() >= 0 and values.max() <= 255)):
        return Image.fromarray(values.astype(np.uint8))
    raise DataError(
        f"Image file {path} holds {'floating-point' if img.mode == 'F' else '32-bit integer'} "
        f"pixel values (Pillow mode {img.mode}, from {values.min()} to {values.max()}), which have "
        "no brightness scale to read them in: convert the images to 8- or 16-bit PNG or TIFF."
    )


# where each of R, G and B sits in a pixel of Pillow's, read as a little-endian 32-bit word
_PLANE_SHIFTS = np.array([0, 8, 16], "<u4").reshape(3, 1, 1)


def _upright_planes(
    path: os.PathLike | str, out: np.ndarray | None = None, fix: str = ""
) -> np.ndarray:
    """Upright RGB uint8 planes [3,H,W] (EXIF orientation applied), written into `out` where it
    has their shape; a bad file raises DataError naming it, and a truncated or corrupt one
    saying `fix` (a data set's image can be left out; a file given to predict is skipped).

    Pillow keeps an RGB pixel in 4 bytes (R, G, B, a pad byte), copied out as they are: packing
    them into 3 costs more. Read as 32-bit words, a plane is the words shifted right by 0, 8 or
    16 bits, cast to their low byte: numpy shifts in one vectorised pass, in about half the
    time its strided copy of every fourth byte takes."""
    try:
        with Image.open(path) as img:
            img.load()
            # a PNG holds at most 16 bits a value: older Pillow opens its grey ones as I
            sixteen_bit = img.mode.startswith("I;16") or (img.mode, img.format) == ("I", "PNG")
            img = upright(img)
            if img.mode.startswith("I") or img.mode == "F":  # one value per pixel, beyond 8 bits
                img = _eight_bit_grey(img, path, sixteen_bit)
            # the decoded pixels as they are where they are RGB already: convert would copy them
            rgb = img if img.mode == "RGB" else img.convert("RGB")
            words = np.frombuffer(rgb.tobytes("raw", "RGBX"), "<u4").reshape(rgb.height, rgb.width)
    except FileNotFoundError as error:
        raise DataError(f"Image file {path} does not exist.") from error
    except Image.DecompressionBombError as error:
        raise DataError(f"Image file {path} is too large to decode: {error} {TOO_LARGE}") from error
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise DataError(
            f"Image file {path} is truncated, corrupt or not an image: {error}. {fix}".rstrip()
        ) from error
    if out is None or out.shape != (3, *words.shape):
        out = np.empty((3, *words.shape), np.uint8)
    return np.right_shift(words, _PLANE_SHIFTS, out=out, casting="unsafe")


def read_image(path: os.PathLike | str) -> torch.Tensor:
    """Upright RGB uint8 [3,H,W] (EXIF orientation applied); a bad file raises DataError naming it."""
    return torch.from_numpy(_upright_planes(path))


def augment_sample(
    image: torch.Tensor,
    boxes: torch.Tensor,
    augment: Augment,
    rng: np.random.Generator,
    library: v2.Compose | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flips, transposition, channel shuffles, then `library` transforms, on a square image.

    The boxes (objects and ignore regions alike) follow the image, in their order. The
    library transforms draw from torch's global RNG, so they run in a fork of it seeded
    from `rng`: the sample stays a function of (seed, epoch, index), and nothing else that
    uses torch's RNG is disturbed.
    """
    size = image.shape[-1]
    hflip = rng.random() < augment.hflip
    vflip = rng.random() < augment.vflip
    transpose = rng.random() < augment.transpose  # with the flips, all eight symmetries
    shuffle = rng.permutation(3) if rng.random() < augment.channel_shuffle else None
    # the image's flips as torchvision's flip kernels do them, both in one copy
    flipped = [dim for dim, flip in ((-1, hflip), (-2, vflip)) if flip]
    if flipped:
        image = image.flip(flipped)
    if transpose:  # numpy copies a transposed uint8 image in a fraction of torch's time
        image = torch.from_numpy(np.ascontiguousarray(image.numpy().transpose(0, 2, 1)))
    if shuffle is not None:  # index_select: plain indexing with a tensor is the slow path
        image = image.index_select(0, torch.from_numpy(shuffle))
    if hflip or vflip or transpose:
        boxes = torch.from_numpy(_mirror_boxes(boxes.numpy(), size, hflip, vflip, transpose))
    if library is not None:
        from torchvision import tv_tensors

        seed = int(rng.integers(2**63))
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(seed)
            img, bbs = library(
                tv_tensors.Image(image.contiguous()),
                tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(size, size)),
            )
        image, boxes = img.as_subclass(torch.Tensor), bbs.as_subclass(torch.Tensor)
    return image.contiguous(), boxes


def _mirror_boxes(
    boxes: np.ndarray, size: int, hflip: bool, vflip: bool, transpose: bool
) -> np.ndarray:
    """xyxy boxes of a `size` square after the flips, then the transposition.

    Each coordinate is mirrored at most once, with torchvision's arithmetic for XYXY boxes,
    -(coordinate - size), so the values are bit for bit those of its flip kernels (a box at
    the far edge comes out at -0.0, as there), without their per-call cost on a few boxes.
    """
    columns = [2 if hflip else 0, 3 if vflip else 1, 0 if hflip else 2, 1 if vflip else 3]
    mirrored = boxes[:, columns]
    mirrored = np.where([hflip, vflip, hflip, vflip], -(mirrored - size), mirrored)
    return mirrored[:, [1, 0, 3, 2]] if transpose else mirrored


class DetectionDataset(Dataset):
    """Samples are (image uint8 [3,S,S], target dict); index with (epoch, i) to seed augmentation."""

    def __init__(
        self,
        split: SplitAnnotations,
        image_size: int,
        resize: str = "letterbox",
        augment: Augment | None = None,
        cache: bool | str = True,
        seed: int = 0,
        cache_budget: float = 0.25,
        memory: Callable[[], image_cache.Memory] | None = None,
    ) -> None:
        """`cache`: true, false or "auto" (cache when the decoded split fits `cache_budget`, a
        fraction, of the memory `memory()` reports available; see pipeline.data.cache)."""
        if resize not in RESIZE_MODES:
            raise DataError(f"data.resize={resize!r} is not one of {', '.join(RESIZE_MODES)}.")
        self.records: list[ImageRecord] = split.records
        self.class_names = split.class_names
        self.image_size = image_size
        self.resize = resize
        self.augment = augment if augment is not None and augment.enabled else None
        self.library = self.augment.library_transforms(image_size) if self.augment else None
        self.seed = seed
        self._cache: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self.cache_decision = image_cache.decide(
            cache,
            len(self.records),
            image_size,
            cache_budget,
            memory or image_cache.available_memory,
        )
        self.fill_plan = cache_fill.plan(len(self.records))
        if not self.cache_decision.cache:
            # decoded one at a time as they are used: every file checked now, as loading does
            check_image_files(split)
        elif split.unchecked_images is None:
            self._cache = self._load_all()
        else:  # decoding every file checks them all: the header check only to word an error
            try:
                self._cache = self._load_all()
            except DataError:
                check_image_files(split)  # raises the error loading would have raised, if any
                raise
            split.unchecked_images = None
        # where each image lies in the letterboxed input, for evaluation's clipping (`region`)
        self._regions = self._input_regions() if self.augment is None else None

    def _input_regions(self) -> tuple[torch.Tensor, ...]:
        """Each sample's `region` (Geometry.region), worked out once per image size, as views
        of one tensor made in one call: per sample, a geometry and a tensor of four numbers
        cost more than the rest of its target."""
        regions: dict[tuple[int, int], list[float]] = {}
        for record in self.records:
            size = (record.height, record.width)
            if size not in regions:
                regions[size] = Geometry.of(*size, self.image_size, self.resize).region()
        every = [regions[(record.height, record.width)] for record in self.records]
        return torch.tensor(every, dtype=torch.float32).reshape(-1, 4).unbind(0)

    def __len__(self) -> int:
        return len(self.records)

    def geometry(self, index: int) -> Geometry:
        record = self.records[index]
        return Geometry.of(record.height, record.width, self.image_size, self.resize)

    def to_original(self, index: int, boxes: np.ndarray) -> np.ndarray:
        """Map input-frame boxes of sample `index` back to its image's own pixels."""
        record = self.records[index]
        return self.geometry(index).to_original(boxes, record.height, record.width)

    def all_to_original(self, boxes: list[np.ndarray]) -> np.ndarray:
        """Input-frame boxes of every sample (one [n,4] array each, in order) in their images'
        own pixels, as `to_original` maps each, one [sum n,4] array: the same float32
        arithmetic, row by row, with the scales of each image size worked out once, without
        numpy's per-call cost per image (most of the work for a few boxes each)."""
        sizes: dict[tuple[int, int], int] = {}
        which = [sizes.setdefault((r.height, r.width), len(sizes)) for r in self.records]
        scale, shift, bounds = (np.zeros((len(sizes), 4), np.float32) for _ in range(3))
        for (height, width), row in sizes.items():
            geometry = Geometry.of(height, width, self.image_size, self.resize)
            scale[row] = [width / geometry.resized[1], height / geometry.resized[0]] * 2
            shift[row] = [geometry.left, geometry.top] * 2
            bounds[row] = [width, height] * 2
        counts = [len(part) for part in boxes]
        rows = np.repeat(np.asarray(which, np.int64), counts)
        every = np.concatenate(
            [
                np.zeros((0, 4), np.float32),
                *(np.asarray(b, np.float32).reshape(-1, 4) for b in boxes),
            ]
        )
        return ((every - shift[rows]) * scale[rows]).clip(0, bounds[rows])

    def _load_all(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Every sample, in order, each image a view of one [N,3,S,S] tensor that the decoders
        write into (`pipeline.data.cache_fill`); the boxes from the annotations, meanwhile."""
        boxes: list[tuple[torch.Tensor, torch.Tensor]] = []

        def read_boxes() -> None:
            boxes.extend(self._boxes(i) for i in range(len(self.records)))

        images = cache_fill.fill(
            len(self.records), self.image_size, self._decode_into, self.fill_plan, read_boxes
        )
        return [(image, *both) for image, both in zip(images, boxes, strict=True)]

    def _load(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The input-frame image, boxes and ignore regions."""
        return self._decode_into(index), *self._boxes(index)

    def _decode_into(self, index: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The input-frame image, written into `out` where given; the decoded image is the
        geometry."""
        record = self.records[index]
        # straight into place where the image is at input size: one copy of its pixels
        planes = _upright_planes(record.path, None if out is None else out.numpy(), NOT_AN_IMAGE)
        height, width = planes.shape[1:]
        if (height, width) != (record.height, record.width):
            raise DataError(
                f"Image file {record.path} is {width}x{height} (EXIF orientation applied), but its "
                f"annotation says {record.width}x{record.height}: boxes are never rescaled to fit."
            )
        if (height, width) == (self.image_size, self.image_size):  # as fit_image leaves them
            return torch.from_numpy(planes) if out is None else out
        image = fit_image(torch.from_numpy(planes), self.image_size, self.resize)
        return image if out is None else out.copy_(image)

    def _boxes(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The input-frame boxes and ignore regions, from the annotation's image size."""
        record = self.records[index]
        if (record.height, record.width) == (self.image_size, self.image_size):
            return (
                torch.from_numpy(np.array(record.boxes, np.float32).reshape(-1, 4)),
                torch.from_numpy(np.array(record.ignore_boxes, np.float32).reshape(-1, 4)),
            )
        both = fit_boxes(
            np.concatenate([record.boxes, record.ignore_boxes]),
            record.height,
            record.width,
            self.image_size,
            self.resize,
        )
        count = len(record.boxes)
        return both[:count], both[count:]

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, dict[str, Any]]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        record = self.records[index]
        image, boxes, ignore_boxes = (
            self._cache[index] if self._cache is not None else self._load(index)
        )
        labels = torch.from_numpy(record.labels)
        ignore_labels = torch.from_numpy(record.ignore_labels)
        if self.augment is not None:
            rng = np.random.default_rng([self.seed, epoch, index])
            count = len(boxes)
            image, both = augment_sample(
                image, torch.cat([boxes, ignore_boxes]), self.augment, rng, self.library
            )
            # in numpy: for the few boxes of an image, torch's per-call cost is the whole cost
            both = both.numpy()
            keep = ((both[:, 2:] - both[:, :2]) >= self.augment.min_box_size).all(axis=1)
            objects, regions = keep[:count], keep[count:]
            boxes = torch.from_numpy(both[:count][objects])
            labels = torch.from_numpy(record.labels[objects])
            ignore_boxes = torch.from_numpy(both[count:][regions])
            ignore_labels = torch.from_numpy(record.ignore_labels[regions])
        target = {
            "boxes": boxes,
            "labels": labels,
            "ignore_boxes": ignore_boxes,
            "ignore_labels": ignore_labels,
            "image_id": record.image_id,
        }
        if self._regions is not None:
            # where the image lies in the letterboxed input: evaluation clips detections to it,
            # so a box reaching into the padding is scored as it maps back to the image
            target["region"] = self._regions[index]
        return image, target


class EpochSampler(Sampler):
    """Yields (epoch, index): a permutation seeded by (seed, epoch), which also seeds augmentation.

    Passing the epoch with each index (instead of setting it on the data set) keeps it
    correct inside persistent DataLoader workers.
    """

    def __init__(self, size: int, shuffle: bool, seed: int) -> None:
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[tuple[int, int]]:
        order = (
            np.random.default_rng([self.seed, self.epoch]).permutation(self.size)
            if self.shuffle
            else range(self.size)
        )
        return iter((self.epoch, int(i)) for i in order)


def collate(
    batch: list[tuple[torch.Tensor, dict[str, Any]]],
) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Stack images; keep targets as a list, since images hold different numbers of boxes."""
    images, targets = zip(*batch, strict=True)
    return _batched(images), list(targets)


def _batched(images: Sequence[torch.Tensor]) -> torch.Tensor:
    """The images as one [B, ...] tensor: where they lie one after the other in one storage (a
    cached split's consecutive samples: evaluation's batches), the view that spans them, the
    values stacking would copy; otherwise stacked. A DataLoader worker always stacks: the view
    would send its whole storage, the cache, to the main process through shared memory."""
    first = images[0]
    storage, step = first.untyped_storage().data_ptr(), first.nbytes
    if get_worker_info() is None and all(
        image.is_contiguous()
        and image.shape == first.shape
        and image.dtype == first.dtype
        and image.untyped_storage().data_ptr() == storage
        and image.data_ptr() == first.data_ptr() + position * step
        for position, image in enumerate(images)
    ):
        return first.as_strided((len(images), *first.shape), (first.numel(), *first.stride()))
    return torch.stack(images)


def default_num_workers(cached: bool) -> int:
    """Cached samples are cheap to produce: worker processes would only steal cores from compute."""
    if cached:
        return 0
    return max(0, min(4, (os.cpu_count() or 1) - 1))


def worker_count(setting: int | str, cached: bool) -> int:
    """data.num_workers as a number of worker processes: auto is `default_num_workers`'."""
    return default_num_workers(cached) if setting == "auto" else int(setting)


def make_loader(
    dataset: DetectionDataset,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    num_workers: int,
    pin_memory: bool,
    drop_last: bool,
) -> DataLoader:
    if drop_last and len(dataset) < batch_size:
        drop_last = False
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=EpochSampler(len(dataset), shuffle, seed),
        num_workers=num_workers,
        collate_fn=collate,
        pin_memory=pin_memory,
        drop_last=drop_last,
        persistent_workers=num_workers > 0,
    )


def loader_for(split: SplitAnnotations, config: dict[str, Any], *, train: bool, pin_memory: bool,
               memory: Callable[[], image_cache.Memory] | None = None) -> DataLoader:  # fmt: skip
    """The DataLoader a config asks for: training (augmented, shuffled) or evaluation.

    Logs whether the split's decoded images are cached, and why (`memory` reports the
    available memory; by default pipeline.data.cache.available_memory)."""
    data = config["data"]
    augment = Augment(**data["augment"]) if train else None
    dataset = DetectionDataset(
        split,
        data["image_size"],
        data["resize"],
        augment,
        data["cache"],
        config["seed"],
        data["cache_budget"],
        memory,
    )
    cached = dataset.cache_decision.cache
    workers = worker_count(data["num_workers"], cached)
    loading = (
        f"samples come from memory, {dataset.fill_plan.reason}"
        if cached
        else f"images are decoded as they are loaded, by {workers} DataLoader worker(s)"
        if workers
        else "images are decoded as they are loaded, in this process"
    )
    log.info("%s: %s; %s", split.origin, dataset.cache_decision.reason, loading)
    batch_size = config["train"]["batch_size"] if train else config["eval"]["batch_size"]
    return make_loader(dataset, batch_size, shuffle=train, seed=config["seed"], num_workers=workers,
                       pin_memory=pin_memory, drop_last=train)  # fmt: skip
