"""The synthetic set: byte-identical for the same spec, per-sample seeding, tight boxes, COCO output."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pycocotools.coco import COCO

from pipeline.config import load_config
from pipeline.config_files import read_yaml
from pipeline.data.shapes import SHAPES, render_sample
from pipeline.data.synthetic import SyntheticSpec, generate
from pipeline.errors import ConfigError
from pipeline.evaluation.coco import SIZE_BUCKETS

REPO = Path(__file__).resolve().parents[1]
PHOTO_PRESETS = ("photographs", "five-minutes-cpu")  # as the README layers them for own data

SMALL = SyntheticSpec(num_train=6, num_val=3, num_test=2, image_size=64, max_object_size=32)
# one object on a flat background: every pixel is the background or a blend of it and the object
FLAT_ONE = dataclasses.replace(
    SMALL,
    num_train=24,
    min_objects=1,
    max_objects=1,
    min_object_size=12,
    noise_std=0,
    texture_strength=0,
)


def _digests(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shapes")
    generate(SMALL, root)
    return root


def test_generate_writes_every_image_and_the_annotation_file_of_each_split(
    generated: Path,
) -> None:
    names = set(_digests(generated))
    assert names == {
        "instances_train.json",
        "instances_val.json",
        "instances_test.json",
        *(f"train/{i:06d}.png" for i in range(6)),
        *(f"val/{i:06d}.png" for i in range(3)),
        *(f"test/{i:06d}.png" for i in range(2)),
    }


def test_the_test_split_leaves_train_and_val_byte_identical_and_num_test_0_omits_it(
    generated: Path, tmp_path: Path
) -> None:
    generate(dataclasses.replace(SMALL, num_test=0), tmp_path / "no_test")
    without = _digests(tmp_path / "no_test")
    assert not any(name.startswith(("test/", "instances_test")) for name in without)
    ours = _digests(generated)
    assert all(ours[name] == digest for name, digest in without.items())


def test_a_larger_test_split_made_alone_keeps_its_first_images_and_touches_no_other_split(
    generated: Path, tmp_path: Path
) -> None:
    written = generate(dataclasses.replace(SMALL, num_test=3), tmp_path, splits=("test",))
    assert set(written) == {"test"}
    alone, ours = _digests(tmp_path), _digests(generated)
    assert set(alone) == {"instances_test.json", *(f"test/{i:06d}.png" for i in range(3))}
    assert all(alone[f"test/{i:06d}.png"] == ours[f"test/{i:06d}.png"] for i in range(2))


def test_a_split_the_spec_does_not_have_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no 'test' split .* data.synthetic.num_test > 0"):
        generate(dataclasses.replace(SMALL, num_test=0), tmp_path, splits=("test",))
    assert not any(tmp_path.iterdir())


def test_test_images_differ_from_train_and_val_images(generated: Path) -> None:
    test = {d for n, d in _digests(generated).items() if n.startswith("test/")}
    others = {d for n, d in _digests(generated).items() if n.startswith(("train/", "val/"))}
    assert len(test) == 2 and not test & others


def test_same_spec_gives_byte_identical_files(generated: Path, tmp_path: Path) -> None:
    generate(SMALL, tmp_path / "again")
    assert _digests(tmp_path / "again") == _digests(generated)


def test_a_different_seed_changes_every_image_and_the_annotations(
    generated: Path, tmp_path: Path
) -> None:
    generate(dataclasses.replace(SMALL, seed=1), tmp_path / "other")
    ours, theirs = _digests(generated), _digests(tmp_path / "other")
    assert ours.keys() == theirs.keys()
    assert all(ours[name] != theirs[name] for name in ours)


def test_a_sample_depends_only_on_seed_split_and_index(generated: Path) -> None:
    # a spec with fewer images still renders sample 2 exactly as the full generation did
    alone, objects = render_sample(dataclasses.replace(SMALL, num_train=3), "train", 2)
    on_disk = np.asarray(Image.open(generated / "train" / "000002.png"))
    np.testing.assert_array_equal(alone, on_disk)
    document = json.loads((generated / "instances_train.json").read_text())
    boxes = [
        [a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2], a["bbox"][1] + a["bbox"][3]]
        for a in document["annotations"]
        if a["image_id"] == 3
    ]
    assert boxes == [list(obj["box"]) for obj in objects]


def test_the_split_is_part_of_a_samples_seed() -> None:
    train, _ = render_sample(SMALL, "train", 0)
    val, _ = render_sample(SMALL, "val", 0)
    assert not np.array_equal(train, val)


def test_rendered_images_are_rgb_uint8_of_the_spec_size() -> None:
    pixels, _ = render_sample(SMALL, "train", 0)
    assert pixels.shape == (64, 64, 3)
    assert pixels.dtype == np.uint8


def test_boxes_lie_inside_the_image_with_positive_size_and_valid_labels() -> None:
    spec = dataclasses.replace(SMALL, max_objects=8, max_truncation=0.5)
    seen = 0
    for index in range(12):
        _, objects = render_sample(spec, "train", index)
        for obj in objects:
            x0, y0, x1, y1 = obj["box"]
            assert 0 <= x0 < x1 <= 64
            assert 0 <= y0 < y1 <= 64
            assert 0 <= obj["label"] < len(spec.classes)
            seen += 1
    assert seen > 10  # the checks above ran on a fair number of boxes


def _coverage(pixels: np.ndarray) -> np.ndarray:
    """How far each pixel lies from the flat background towards the object's colour (0..1)."""
    flat = pixels.reshape(-1, 3).astype(np.float64)
    values, counts = np.unique(flat, axis=0, return_counts=True)
    background = values[counts.argmax()]
    colour = flat[np.linalg.norm(flat - background, axis=1).argmax()]
    direction = colour - background
    return ((pixels - background) @ direction / (direction @ direction)).astype(np.float64)


def _bbox(mask: np.ndarray) -> tuple[int, int, int, int]:
    ys, xs = np.nonzero(mask)
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


def test_box_encloses_exactly_the_pixels_the_object_covers_at_least_half() -> None:
    """The module's sense of tight: the bounding box of pixels with coverage >= 0.5.

    Coverage comes in sixteenths (4x4 supersampling); 8/16 rounds to 128/255 and counts as
    visible, 7/16 does not. Read back from uint8 pixels it is accurate to about 0.01, so a
    threshold of 0.47 separates the two.
    """
    for index in range(FLAT_ONE.num_train):
        pixels, objects = render_sample(FLAT_ONE, "train", index)
        assert len(objects) == 1
        assert _bbox(_coverage(pixels) >= 0.47) == objects[0]["box"], index


def test_pixels_outside_the_box_differ_from_the_background_only_in_a_one_pixel_fringe() -> None:
    fringe = 0
    for index in range(FLAT_ONE.num_train):
        pixels, objects = render_sample(FLAT_ONE, "train", index)
        x0, y0, x1, y1 = (int(v) for v in objects[0]["box"])
        changed = _coverage(pixels) != 0
        cx0, cy0, cx1, cy1 = _bbox(changed)
        assert x0 - 1 <= cx0 <= x0 and y0 - 1 <= cy0 <= y0
        assert x1 <= cx1 <= x1 + 1 and y1 <= cy1 <= y1 + 1
        inside = np.zeros_like(changed)
        inside[y0:y1, x0:x1] = True
        assert (_coverage(pixels)[changed & ~inside] < 0.47).all()
        fringe += int((changed & ~inside).any())
    assert fringe > 0  # anti-aliasing does blend pixels outside the box


def test_images_without_objects_occur_with_min_objects_zero_and_are_plain_background() -> None:
    spec = dataclasses.replace(FLAT_ONE, min_objects=0)
    empty = []
    for index in range(12):
        pixels, objects = render_sample(spec, "train", index)
        if not objects:
            empty.append(index)
            assert len(np.unique(pixels.reshape(-1, 3), axis=0)) == 1
    assert empty


def test_min_objects_is_a_lower_bound_on_placed_objects() -> None:
    spec = dataclasses.replace(SMALL, min_objects=2, max_objects=3, max_object_size=16)
    counts = [len(render_sample(spec, "train", i)[1]) for i in range(8)]
    assert all(2 <= n <= 3 for n in counts), counts


def test_coco_files_load_in_pycocotools_with_categories_named_after_the_classes(
    generated: Path,
) -> None:
    for split, count in (("train", 6), ("val", 3)):
        with contextlib.redirect_stdout(io.StringIO()):
            coco = COCO(str(generated / f"instances_{split}.json"))
        categories = coco.loadCats(coco.getCatIds())
        assert [c["name"] for c in categories] == list(SMALL.classes)
        assert sorted(coco.getImgIds()) == list(range(1, count + 1))
        for image in coco.loadImgs(coco.getImgIds()):
            assert (generated / image["file_name"]).is_file()
            assert (image["width"], image["height"]) == (64, 64)
        for ann in coco.loadAnns(coco.getAnnIds()):
            x, y, w, h = ann["bbox"]
            assert w > 0 and h > 0 and x >= 0 and y >= 0 and x + w <= 64 and y + h <= 64
            assert ann["area"] == pytest.approx(w * h)
            assert ann["category_id"] in coco.getCatIds()
    assert len(coco.getAnnIds()) > 0


def test_coco_annotations_match_render_sample(generated: Path) -> None:
    document = json.loads((generated / "instances_val.json").read_text())
    for index in range(3):
        _, objects = render_sample(SMALL, "val", index)
        anns = [a for a in document["annotations"] if a["image_id"] == index + 1]
        assert [a["category_id"] - 1 for a in anns] == [o["label"] for o in objects]


def test_from_config_builds_the_spec_and_takes_classes_as_a_list() -> None:
    spec = SyntheticSpec.from_config({"num_train": 5, "classes": ["ring", "star"], "seed": 3})
    assert spec == dataclasses.replace(
        SyntheticSpec(), num_train=5, classes=("ring", "star"), seed=3
    )


def test_from_config_rejects_unknown_keys_naming_them() -> None:
    with pytest.raises(ConfigError, match="num_tests"):
        SyntheticSpec.from_config({"num_train": 5, "num_tests": 2})


@pytest.mark.parametrize(
    "classes", [["circle", "hexagon"], [], ["circle", "circle"]], ids=["unknown", "empty", "dup"]
)
def test_from_config_rejects_invalid_shape_lists(classes: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"data\.synthetic\.classes") as caught:
        SyntheticSpec.from_config({"classes": classes})
    assert all(shape in str(caught.value) for shape in SHAPES)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"min_objects": 4, "max_objects": 2}, "min_objects=4"),
        ({"min_object_size": 40, "max_object_size": 20}, "object sizes"),
        ({"image_size": 32, "max_object_size": 48}, "object sizes"),
    ],
)
def test_from_config_rejects_inconsistent_counts_and_sizes(settings: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        SyntheticSpec.from_config(settings)


# Four classes of different sizes, as in real data; "cross" comes at every size.
SIZED = dataclasses.replace(
    SMALL,
    min_objects=6,
    max_objects=10,
    min_object_size=4,
    max_object_size=40,
    max_overlap=0.5,
    min_visible=0.0,
    class_sizes=(("circle", 4, 8), ("square", 8, 20), ("triangle", 20, 40)),
)


def test_class_sizes_keep_each_class_inside_its_size_range() -> None:
    largest = {name: 0.0 for name in SIZED.classes}
    for index in range(16):
        _, objects = render_sample(SIZED, "train", index)
        for obj in objects:
            x0, y0, x1, y1 = obj["box"]
            name = SIZED.classes[obj["label"]]
            largest[name] = max(largest[name], x1 - x0, y1 - y0)
    # a box spans the visible pixels: never more than the nominal size (+1 for the rounding)
    assert largest["circle"] <= 8 + 1 and largest["square"] <= 20 + 1
    assert largest["triangle"] > 20 and largest["cross"] > 20  # the large ones do occur
    assert all(value > 0 for value in largest.values())  # every class occurs


def test_class_sizes_that_span_the_whole_range_change_no_byte() -> None:
    """A size is drawn first, then a class among those it fits: with every class fitting
    every size, the random stream is that of a spec without class_sizes (the default set)."""
    spec = dataclasses.replace(SMALL, max_objects=8)
    whole = tuple((name, spec.min_object_size, spec.max_object_size) for name in spec.classes)
    for index in range(6):
        pixels, objects = render_sample(spec, "train", index)
        same, same_objects = render_sample(
            dataclasses.replace(spec, class_sizes=whole), "train", index
        )
        np.testing.assert_array_equal(pixels, same)
        assert objects == same_objects


def test_from_config_takes_class_sizes_as_a_mapping_of_ranges() -> None:
    spec = SyntheticSpec.from_config(
        {"min_object_size": 4, "class_sizes": {"circle": [4, 12], "square": [10, 48]}}
    )
    assert spec.class_sizes == (("circle", 4.0, 12.0), ("square", 10.0, 48.0))
    assert spec.size_range(0) == (4.0, 12.0) and spec.size_range(2) == (4.0, 48.0)
    assert SyntheticSpec.from_config({"class_sizes": None}).class_sizes == ()


@pytest.mark.parametrize(
    ("class_sizes", "named"),
    [
        ({"ring": [8, 20]}, "'ring', which is not one of"),
        ({"circle": [4, 20]}, r"class_sizes\.circle=\[4\.0, 20\.0\] must be a range"),
        ({"circle": [30, 20]}, "must be a range"),
        ({"circle": [8, 60]}, "inside min_object_size=8"),
        ({"circle": [8, 20]} | {n: [8, 20] for n in ("square", "triangle", "cross")}, "from 20"),
        ({"circle": [8]}, r"must be \[smallest, largest\]"),
    ],
)
def test_class_sizes_that_do_not_fit_are_rejected_naming_the_class(
    class_sizes: dict, named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        SyntheticSpec.from_config({"class_sizes": class_sizes})


def test_categories_follow_the_spec_class_order(tmp_path: Path) -> None:
    spec = SyntheticSpec(
        num_train=1,
        num_val=1,
        num_test=1,
        image_size=32,
        classes=("star", "ring"),
        max_object_size=16,
    )
    written = generate(spec, tmp_path)
    assert set(written) == {"train", "val", "test"}
    for path in written.values():
        with contextlib.redirect_stdout(io.StringIO()):
            coco = COCO(str(path))
        assert [(c["id"], c["name"]) for c in coco.loadCats(coco.getCatIds())] == [
            (1, "star"),
            (2, "ring"),
        ]


def test_the_multiscale_preset_spans_4_px_to_60_percent_in_its_own_data_root() -> None:
    preset = REPO / "config" / "presets" / "multiscale.yaml"
    data = load_config(preset)["data"]
    assert data["root"] != load_config(None)["data"]["root"]
    spec = SyntheticSpec.from_config(data["synthetic"])
    assert spec.image_size == data["image_size"]  # the model sees the sizes as generated
    assert spec.min_object_size <= 4 and spec.max_object_size >= 0.6 * spec.image_size
    ranges = [spec.size_range(label) for label in range(len(spec.classes))]
    assert len({r for r in ranges}) == len(ranges)  # every class its own sizes


def test_the_multiscale_preset_cuts_large_classes_into_the_medium_bucket_at_a_border() -> None:
    """A class whose objects are all large (rings) must still reach the medium bucket often
    enough, in training and in test, that a handful of objects cut at a corner do not decide
    a fifth of that bucket's AP: a ring cut by one border (up to max_truncation of its width
    outside) has a box side sqrt(w * h) under 64 px."""
    data = load_config(REPO / "config" / "presets" / "multiscale.yaml")["data"]
    spec = SyntheticSpec.from_config(data["synthetic"])
    medium_upper = SIZE_BUCKETS["medium"][1]
    large_only = [
        label for label in range(len(spec.classes)) if spec.size_range(label)[0] >= medium_upper
    ]
    assert large_only  # the preset has such a class; otherwise this checks nothing
    for label in large_only:
        smallest = spec.size_range(label)[0]
        cut_at_one_border = math.sqrt(smallest * smallest * (1 - spec.max_truncation))
        assert cut_at_one_border < medium_upper, spec.classes[label]


@pytest.mark.parametrize("kind", ["microscopy-kind", "large-objects-kind"])
def test_a_stand_in_preset_layers_over_the_photographs_and_budget_ones_and_keeps_its_data_root(
    kind: str,
) -> None:
    """The stand-ins for real data sets set the data alone: training and augmentation are the
    photographs and five-minutes-cpu presets', as a user's own data file would leave them."""
    presets = [REPO / "config" / "presets" / f"{name}.yaml" for name in PHOTO_PRESETS]
    under = load_config(presets)
    config = load_config([*presets, REPO / "config" / "presets" / f"{kind}.yaml"])
    assert config["train"] == under["train"]
    assert config["data"]["augment"] == under["data"]["augment"]
    roots = {
        load_config(REPO / "config" / "presets" / f"{name}.yaml")["data"]["root"]
        for name in ("multiscale", "microscopy-kind", "large-objects-kind")
    }
    assert len(roots | {under["data"]["root"]}) == 4
    assert SyntheticSpec.from_config(config["data"]["synthetic"]).num_test > 0


def test_the_photographs_and_budget_presets_each_set_one_thing() -> None:
    """Augmentation, scores and the flip test for photographs; a five-minute CPU budget:
    nothing of the other's."""
    folder = REPO / "config" / "presets"
    photographs = read_yaml(folder / "photographs.yaml")
    assert set(photographs) == {"data", "model", "eval"}
    assert set(photographs["data"]) == {"augment"}
    assert photographs["model"] == {"iou_score": True}
    assert photographs["eval"] == {"flip_test": True}
    assert set(read_yaml(folder / "five-minutes-cpu.yaml")) == {"train"}
    assert load_config(folder / "five-minutes-cpu.yaml")["train"]["time_budget_s"] is not None


def test_the_microscopy_stand_in_has_classes_an_order_of_magnitude_apart_in_input_pixels() -> None:
    data = load_config(REPO / "config" / "presets" / "microscopy-kind.yaml")["data"]
    spec = SyntheticSpec.from_config(data["synthetic"])
    scale = data["image_size"] / spec.image_size
    ranges = sorted(spec.size_range(label) for label in range(len(spec.classes)))
    assert len(ranges) == 3
    (smallest, _), (_, largest) = ranges[0], ranges[-1]
    # as 20-px and 200-px objects reach the model from a 640-px image letterboxed to 384
    assert smallest * scale <= 12 and largest * scale >= 120


# A spec that exercises every code path of the renderer: all six shapes (rings and crosses
# draw extra random numbers), crowded images (occlusion and the min_visible test), truncation
# at the border, and per-class sizes.
PINNED = SyntheticSpec(
    num_train=10,
    num_val=4,
    num_test=8,
    image_size=96,
    classes=SHAPES,
    min_objects=1,
    max_objects=9,
    max_object_size=60,
    max_truncation=0.45,
    class_sizes=(("ring", 20.0, 60.0), ("star", 8.0, 30.0)),
    seed=7,
)
# Written from the renderer as it was before it was made faster (main at ff74fe1): any change
# to these is a change to the generated data set, which must be deliberate.
PINNED_PIXELS = "2ae6dd593a8429b3ec7c9cd64b1c221ccd6997dc451741c754ebbad1f198f20f"
PINNED_ANNOTATIONS = "f954ec8a13bb27171ccb739662bb057c5ab184e362374a358b31993ff335b114"
PINNED_DEFAULT_SPEC = "aded0fc1e47cecc3691d230788c5ab02c7fdbbb138539495ead9720dedbf7124"


def _pixel_digest(arrays) -> str:
    """The decoded pixels, not PNG bytes: zlib versions may encode the same image differently."""
    digest = hashlib.sha256()
    for pixels in arrays:
        digest.update(str(pixels.shape).encode())
        digest.update(np.ascontiguousarray(pixels).tobytes())
    return digest.hexdigest()


def test_a_spec_generates_the_same_pixels_and_annotations_as_it_always_has(
    tmp_path: Path,
) -> None:
    generate(PINNED, tmp_path, workers=1)
    pngs = sorted(tmp_path.rglob("*.png"))
    assert len(pngs) == PINNED.num_train + PINNED.num_val + PINNED.num_test
    pixels = (np.asarray(Image.open(path).convert("RGB")) for path in pngs)
    annotations = hashlib.sha256()
    for split in PINNED.splits:
        annotations.update((tmp_path / f"instances_{split}.json").read_bytes())
    assert _pixel_digest(pixels) == PINNED_PIXELS
    assert annotations.hexdigest() == PINNED_ANNOTATIONS


def test_the_default_spec_renders_the_same_samples_as_it_always_has() -> None:
    spec = SyntheticSpec()
    samples = [render_sample(spec, split, index) for split in spec.splits for index in range(4)]
    objects = json.dumps([objs for _, objs in samples], sort_keys=True).encode()
    digest = _pixel_digest(pixels for pixels, _ in samples)
    assert hashlib.sha256(digest.encode() + objects).hexdigest() == PINNED_DEFAULT_SPEC


def test_the_written_pngs_are_valid_and_decode_to_the_rendered_pixels(generated: Path) -> None:
    for index in range(SMALL.num_train):
        path = generated / f"train/{index:06d}.png"
        with Image.open(path) as image:
            image.verify()  # chunk CRCs and structure
        pixels, _ = render_sample(SMALL, "train", index)
        assert np.array_equal(np.asarray(Image.open(path)), pixels)


def test_the_written_pngs_store_every_row_unfiltered(generated: Path) -> None:
    """Pillow filters every row of an RGB PNG it writes, and undoing the filters was most of
    what decoding one cost each loader."""
    data = (generated / "train/000000.png").read_bytes()
    chunks, at = {}, 8
    while at < len(data):
        length = int.from_bytes(data[at : at + 4], "big")
        kind = data[at + 4 : at + 8].decode()
        chunks[kind] = chunks.get(kind, b"") + data[at + 8 : at + 8 + length]
        at += 12 + length
    size = SMALL.image_size
    assert chunks["IHDR"][8:] == bytes([8, 2, 0, 0, 0])  # 8-bit RGB, not interlaced
    rows = np.frombuffer(zlib.decompress(chunks["IDAT"]), np.uint8).reshape(size, 1 + 3 * size)
    assert not rows[:, 0].any()  # each row's filter type: None
    assert np.array_equal(rows[:, 1:].reshape(size, size, 3), render_sample(SMALL, "train", 0)[0])


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names open files via /proc")
def test_generate_flushes_a_splits_images_at_once_before_its_annotation_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One fsync per image made generation wait on the disk for every file; the images must
    still be on disk before the file that says their split is complete."""
    calls: list[str] = []
    fsync, sync = os.fsync, os.sync

    def recording_fsync(fd: int) -> None:
        calls.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name.split(".")[1])
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "sync", lambda: (calls.append("sync"), sync()))
    generate(SMALL, tmp_path, workers=1)
    assert calls == ["sync", "instances_train", "sync", "instances_val", "sync", "instances_test"]
