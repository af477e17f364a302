"""benchmarks/host_work.py: side B is a revision's own module, read from git, beside this tree's."""

from __future__ import annotations

import numpy as np
from benchmark_modules import load

from pipeline.data import shapes, synthetic

host_work = load("host_work")


def test_the_baseline_side_is_the_revisions_module_and_renders_as_this_trees_at_head() -> None:
    old = host_work.baseline_module("HEAD", "pipeline/data/synthetic.py", "head_synthetic")
    assert old.__file__ == "HEAD:src/pipeline/data/synthetic.py"
    renderer = host_work.baseline_renderer("HEAD", old)
    assert renderer.__file__ == "HEAD:src/pipeline/data/shapes.py"
    assert renderer.render_sample is not shapes.render_sample
    assert old.render_sample is renderer.render_sample  # the revision's generate renders with it
    spec = synthetic.SyntheticSpec(image_size=64, max_object_size=32)
    old_spec = old.SyntheticSpec(image_size=64, max_object_size=32)
    for index in range(3):
        pixels, objects = shapes.render_sample(spec, "val", index)
        old_pixels, old_objects = renderer.render_sample(old_spec, "val", index)
        assert np.array_equal(pixels, old_pixels) and objects == old_objects


def test_alternate_runs_the_sides_abba_and_keeps_each_sides_figures_in_round_order() -> None:
    calls = []
    samples = host_work.alternate(
        {"A": lambda r: calls.append(("A", r)) or r, "B": lambda r: calls.append(("B", r)) or -r},
        rounds=3,
    )
    assert calls == [("A", 0), ("B", 0), ("B", 1), ("A", 1), ("A", 2), ("B", 2)]
    assert samples == {"A": [0, 1, 2], "B": [0, -1, -2]}
