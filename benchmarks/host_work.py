"""Host work of the default chain: making the synthetic set and feeding training, this tree's
code (side A) against a baseline revision's (side B), side by side in one process.

Side B is the baseline's own `pipeline/data/synthetic.py` (with `pipeline/data/shapes.py`
where it has one), `pipeline/data/dataset.py` and `pipeline/models/targets.py`, read with
`git show` (default: ff74fe1, the last commit before generation and augmentation were made
cheaper). Rows, each timed in blocks that alternate ABBA for R rounds:

- render: `render_sample` of the default spec (training images), ms per image;
- png: the PNG encoding of those images with the tree's writer (`synthetic.png_bytes`, A)
  against Pillow's defaults (B), ms per image, and the mean file size of each;
- png_decode: decoding those files as every loader does (`dataset.read_image`), ms per image;
- generate: `generate` of the splits the prepare_data (train, val) and prepare_test_data (test)
  jobs make, with every usable CPU, seconds per job (the jobs' own process start-up excluded);
- loader: the default config's cached training DataLoader (augmentation, collate), ms per batch,
  over the set side A generated;
- plan: the loss's target plan (`pipeline.models.targets.plan_targets`) of those batches, ms per
  batch;
- train: the Trainer's training step fed by either loader, ms per step (needs torch compute;
  `--no-train` leaves it out).

Every row is also checked for equal output: the same pixels and objects, the same batches.
There is no target: the figures say what each change saved, and `benchmarks/report_time.py`
measures the whole chain.
"""

from __future__ import annotations

import dataclasses
import io
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import numpy as np
import torch
from PIL import Image

from pipeline import timing
from pipeline.config import load_config
from pipeline.cpus import usable_cpu_count
from pipeline.data import dataset as tree_dataset
from pipeline.data import load_splits
from pipeline.data import shapes as tree_shapes
from pipeline.data import synthetic as tree_synthetic
from pipeline.models import targets as tree_targets
from pipeline.models.centernet import STRIDE

NAME = "host_work"
BASELINE = "ff74fe1"
JOBS = {"prepare_data": ("train", "val"), "prepare_test_data": ("test",)}


def parse_args(argv: list[str]):
    parser = harness.parser(NAME, __doc__)
    harness.add_torch_options(parser)
    parser.add_argument("--baseline", default=BASELINE, help="git revision whose code is side B")
    parser.add_argument("--rounds", type=int, default=6, help="R: rounds of the per-item rows")
    parser.add_argument("--images", type=int, default=100, help="images per render/png block")
    parser.add_argument("--job-rounds", type=int, default=2, help="rounds of the generate rows")
    parser.add_argument("--steps", type=int, default=16, help="steps per train block")
    parser.add_argument("--no-train", action="store_true", help="leave the train row out")
    parser.add_argument(
        "settings",
        nargs="*",
        metavar="key=value",
        help="config overrides of the loader and train rows, e.g. precision=bf16",
    )
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, "rounds", "images", "job_rounds", "steps")
    return args


def baseline_module(revision: str, path: str, name: str) -> types.ModuleType:
    """The module at `src/<path>` as the baseline revision has it (its imports: this tree's)."""
    source = harness.git("show", f"{revision}:src/{path}")
    module = types.ModuleType(name)
    module.__file__ = f"{revision}:src/{path}"
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def baseline_renderer(revision: str, synthetic: types.ModuleType) -> types.ModuleType:
    """The baseline's module that renders a sample: its `pipeline/data/shapes.py` where it has
    one (then its `synthetic`'s generate renders with it too, not with this tree's), else its
    `synthetic` itself, where render_sample lived before."""
    try:
        harness.git("cat-file", "-e", f"{revision}:src/pipeline/data/shapes.py")
    except subprocess.CalledProcessError:
        return synthetic
    shapes = baseline_module(revision, "pipeline/data/shapes.py", "baseline_shapes")
    synthetic.render_sample = shapes.render_sample
    return shapes


def alternate(sides: dict[str, Callable[[int], float]], rounds: int) -> dict[str, list[float]]:
    """Each side's figure per round, ABBA; a side is called with the round's number."""
    samples: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            samples[name].append(sides[name](index))
    return samples


def row(label: str, unit: str, samples: dict[str, list[float]], **extra: Any) -> dict[str, Any]:
    a, b = statistics.median(samples["A"]), statistics.median(samples["B"])
    return {"label": label, "unit": unit, "A": a, "B": b, "B/A": b / a, "samples": samples, **extra}


def timed_each(fn: Callable[[int], object], items: range) -> float:
    start = time.perf_counter()
    for item in items:
        fn(item)
    return (time.perf_counter() - start) / len(items) * 1000


def render_row(
    args, old: types.ModuleType, old_renderer: types.ModuleType
) -> tuple[dict[str, Any], list[np.ndarray]]:
    spec, old_spec = tree_synthetic.SyntheticSpec(), old.SyntheticSpec()
    for index in range(args.images):  # equal output, and a warm-up
        a_pixels, a_objects = tree_shapes.render_sample(spec, "train", index)
        b_pixels, b_objects = old_renderer.render_sample(old_spec, "train", index)
        if not (np.array_equal(a_pixels, b_pixels) and a_objects == b_objects):
            raise RuntimeError(f"render_sample differs from {args.baseline}'s at index {index}")
    span = args.images

    def side(module, spec):
        return lambda r: timed_each(
            lambda i: module.render_sample(spec, "train", i), range(r * span, (r + 1) * span)
        )

    samples = alternate(
        {"A": side(tree_shapes, spec), "B": side(old_renderer, old_spec)}, args.rounds
    )
    images = [tree_shapes.render_sample(spec, "train", i)[0] for i in range(span)]
    return row("render_sample, ms per image", "ms", samples), images


def png_rows(args, images: list[np.ndarray]) -> dict[str, dict[str, Any]]:
    """Encoding the images with this tree's writer (A) and with Pillow's defaults (B), and
    decoding those files as the loaders do (`dataset.read_image`)."""

    def encode(pixels: np.ndarray, kind: str) -> bytes:
        if kind == "A":
            return tree_synthetic.png_bytes(pixels)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="PNG")
        return out.getvalue()

    files = {kind: [encode(pixels, kind) for pixels in images] for kind in ("A", "B")}
    size = {kind: statistics.mean(len(blob) for blob in files[kind]) for kind in files}
    for index, pixels in enumerate(images):
        for kind in files:
            decoded = tree_dataset.read_image(io.BytesIO(files[kind][index])).numpy()
            if not np.array_equal(decoded.transpose(1, 2, 0), pixels):
                raise RuntimeError(f"side {kind}'s PNG of image {index} decodes to other pixels")
    encoding = alternate(
        {k: lambda r, k=k: timed_each(lambda i: encode(images[i], k), range(len(images)))
         for k in files},
        args.rounds,
    )  # fmt: skip
    decoding = alternate(
        {k: lambda r, k=k: timed_each(
            lambda i: tree_dataset.read_image(io.BytesIO(files[k][i])), range(len(images)))
         for k in files},
        args.rounds,
    )  # fmt: skip
    return {
        "png": row(
            "PNG encoding, ms per image",
            "ms",
            encoding,
            mean_bytes=size,
            size_ratio_a_to_b=size["A"] / size["B"],
        ),
        "png_decode": row("PNG decoding (read_image), ms per image", "ms", decoding),
    }


def generate_rows(args, old: types.ModuleType, root: Path) -> dict[str, dict[str, Any]]:
    workers = usable_cpu_count()
    rows = {}
    for job, splits in JOBS.items():
        outputs: dict[str, Path] = {}

        def side(module, kind, splits=splits, outputs=outputs):
            def run(index: int) -> float:
                out = root / f"{kind}-{index}"
                start = time.perf_counter()
                module.generate(module.SyntheticSpec(), out, workers=workers, splits=splits)
                seconds = time.perf_counter() - start
                outputs[kind] = out
                return seconds

            return run

        samples = alternate({"A": side(tree_synthetic, "A"), "B": side(old, "B")}, args.job_rounds)
        for split in splits:
            for name in (f"instances_{split}.json",):
                if (outputs["A"] / name).read_bytes() != (outputs["B"] / name).read_bytes():
                    raise RuntimeError(f"{job}: {name} differs from {args.baseline}'s")
        rows[job] = row(f"generate {'+'.join(splits)} ({job}), {workers} workers, s", "s", samples)
    return rows


def loaders(args, old: types.ModuleType, root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The default config's training loaders of both sides over the set at `root`."""
    config = load_config(
        None, [f"data.root={root}", f"seed={args.seed}", *args.settings, "data.cache=true"]
    )
    train, _ = load_splits(config)
    made = {}
    for kind, module in (("A", tree_dataset), ("B", old)):
        dataset = module.DetectionDataset(
            train,
            config["data"]["image_size"],
            config["data"]["resize"],
            module.Augment(**config["data"]["augment"]),
            True,
            config["seed"],
        )
        made[kind] = module.make_loader(
            dataset,
            config["train"]["batch_size"],
            shuffle=True,
            seed=config["seed"],
            num_workers=0,
            pin_memory=False,
            drop_last=True,
        )
    return made, config


def same_batches(a, b) -> bool:
    (ia, ta), (ib, tb) = a, b
    keys = ("boxes", "labels", "ignore_boxes", "ignore_labels")
    return torch.equal(ia, ib) and all(
        x[k].dtype == y[k].dtype and x[k].numpy().tobytes() == y[k].numpy().tobytes()
        for x, y in zip(ta, tb, strict=True)
        for k in keys
    )


def loader_row(args, made: dict[str, Any]) -> dict[str, Any]:
    for kind in made:
        made[kind].sampler.set_epoch(0)
    if not all(same_batches(a, b) for a, b in zip(made["A"], made["B"], strict=True)):
        raise RuntimeError(f"the training batches differ from {args.baseline}'s")

    def side(kind):
        def epoch(index: int) -> float:
            loader = made[kind]
            loader.sampler.set_epoch(index + 1)
            start = time.perf_counter()
            count = sum(1 for _ in loader)
            return (time.perf_counter() - start) / count * 1000

        return epoch

    samples = alternate({"A": side("A"), "B": side("B")}, args.rounds)
    return row("training DataLoader (cached), ms per batch", "ms", samples)


def plan_row(args, made: dict[str, Any], old: types.ModuleType) -> dict[str, Any]:
    made["A"].sampler.set_epoch(0)
    batches = [targets for _, targets in made["A"]]
    config = load_config(None, args.settings)
    classes = len(config["data"]["synthetic"]["classes"])
    stride, cells = STRIDE, config["data"]["image_size"] // STRIDE
    h = w = cells
    for targets in batches:
        a = tree_targets.plan_targets(targets, classes, stride, h, w)
        b = old.plan_targets(targets, classes, stride, h, w)
        for field in dataclasses.fields(a):
            x, y = getattr(a, field.name), getattr(b, field.name)
            same = (
                x.dtype == y.dtype and x.numpy().tobytes() == y.numpy().tobytes()
                if isinstance(x, torch.Tensor)
                else x == y
            )
            if not same:
                raise RuntimeError(f"plan_targets' {field.name} differs from {args.baseline}'s")

    def side(module):
        return lambda r: timed_each(
            lambda i: module.plan_targets(batches[i], classes, stride, h, w), range(len(batches))
        )

    samples = alternate({"A": side(tree_targets), "B": side(old)}, args.rounds)
    return row("the loss's target plan, ms per batch", "ms", samples)


def train_row(args, made: dict[str, Any], config: dict[str, Any], device) -> dict[str, Any]:
    config = load_config(
        None,
        [
            f"data.root={config['data']['root']}",
            f"seed={args.seed}",
            f"device={device}",
            *args.settings,
        ],
    )
    trainer = harness.stepping_trainer(config)
    feeds = {kind: iter(()) for kind in made}
    epochs = {kind: 0 for kind in made}

    def next_batch(kind: str):
        batch = next(feeds[kind], None)
        if batch is None:
            epochs[kind] += 1
            made[kind].sampler.set_epoch(epochs[kind])
            feeds[kind] = iter(made[kind])
            batch = next(feeds[kind])
        return batch

    def side(kind):
        def block(index: int) -> float:
            times = [
                timing.timed_step(lambda: trainer.train_step(*next_batch(kind)), device)
                for _ in range(args.steps)
            ]
            return statistics.median(times) * 1000

        return block

    for kind in made:  # warm-up
        for _ in range(4):
            trainer.train_step(*next_batch(kind))
    samples = alternate({"A": side("A"), "B": side("B")}, args.rounds)
    return row(
        f"training step fed by the loader ({trainer.precision}), median ms per step",
        "ms",
        samples,
        precision=trainer.precision,
    )


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = harness.setup_torch(args)
    old_synthetic = baseline_module(args.baseline, "pipeline/data/synthetic.py", "baseline_synth")
    old_renderer = baseline_renderer(args.baseline, old_synthetic)
    old_dataset = baseline_module(args.baseline, "pipeline/data/dataset.py", "baseline_dataset")
    old_targets = baseline_module(args.baseline, "pipeline/models/targets.py", "baseline_targets")
    print(
        f"{NAME}: side A this tree, side B {args.baseline}; {torch.get_num_threads()} torch "
        f"threads, {usable_cpu_count()} usable CPUs",
        flush=True,
    )
    conditions = timing.RunConditions()
    rows: dict[str, dict[str, Any]] = {}
    rows["render"], images = render_row(args, old_synthetic, old_renderer)
    rows.update(png_rows(args, images))
    with tempfile.TemporaryDirectory() as root:
        rows.update(generate_rows(args, old_synthetic, Path(root)))
        made, config = loaders(args, old_dataset, Path(root) / "A-0")
        rows["loader"] = loader_row(args, made)
        rows["plan"] = plan_row(args, made, old_targets)
        if not args.no_train:
            rows["train"] = train_row(args, made, config, device)
    conditions = conditions.finish()
    harness.warn_if_loaded(conditions, NAME)

    print(
        harness.table(
            ("row", "A (this tree)", "B (baseline)", "B/A", "unit"),
            [[r["label"], r["A"], r["B"], r["B/A"], r["unit"]] for r in rows.values()],
        )
    )
    png = rows["png"]
    print(
        f"PNG size: {png['mean_bytes']['A'] / 1024:.1f} KiB (A) against "
        f"{png['mean_bytes']['B'] / 1024:.1f} KiB (B), A/B {png['size_ratio_a_to_b']:.4f}"
    )
    print(f"took {time.perf_counter() - started:.0f} s")
    figures = []
    for key, r in rows.items():
        figures += [
            harness.figure(f"{key}.a", f"{r['label']}, this tree", r["A"], r["unit"]),
            harness.figure(f"{key}.b", f"{r['label']}, {args.baseline}", r["B"], r["unit"]),
            harness.figure(f"{key}.ratio", f"{r['label']}: B / A", r["B/A"], "ratio"),
        ]
    figures.append(
        harness.figure(
            "png.size_ratio", "PNG mean file size, A / B", png["size_ratio_a_to_b"], "ratio"
        )
    )
    settings = {
        "baseline": args.baseline,
        "rounds": args.rounds,
        "images": args.images,
        "job_rounds": args.job_rounds,
        "steps": args.steps,
    }
    flags = harness.condition_flags(conditions, NAME)
    harness.write_record(args, harness.record(NAME, figures, settings=settings, flags=flags))
    record = {
        "benchmark": NAME,
        "rows": rows,
        "settings": settings,
        "conditions": conditions,
        "environment": harness.environment(device),
    }
    return harness.finish(args.out, record, True, args.check)


if __name__ == "__main__":
    harness.run(main)
