"""How a detection's score should weigh the IoU branch: runs trained with `model.iou_score`
re-decoded at several IOU_SCORE_ALPHA (0: the heatmap alone, 1: the predicted IoU alone).

For each `real_sets.py measure` record given (trained with `model.iou_score=true`), its run
folder's best.pth is evaluated as `python -m pipeline evaluate` does, once per alpha, with the
operating point picked again on validation at that alpha (the one saved was picked at the
shipped alpha). Alpha 0 is the heatmap alone: since the heatmap and boxes train as without the
branch, it is the run without the key, and each alpha's difference from it is what scoring alone
changes. Prints every run and the means over runs per alpha, and records
the means (no target: a comparison).

    python benchmarks/iou_score_alpha.py --set eggs \\
        benchmarks/records/real/eggs-fp32-15ep-iouscore-seed*-SHA.json
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

import harness
import numpy as np

from pipeline import cli
from pipeline.engine import checkpoint
from pipeline.errors import DataError
from pipeline.models import centernet

NAME = "iou_score_alpha"
KEYS = ("ap50", "ap", "f1", "score_threshold")
UNITS = {"ap50": "AP", "ap": "AP", "f1": "F1", "score_threshold": "fraction"}


def parse_args(argv: list[str]):
    parser = harness.parser(NAME, __doc__)
    parser.add_argument("--set", required=True, help="the set's name, for the record")
    parser.add_argument("records", nargs="+", type=Path, help="real_sets records, iou_score on")
    parser.add_argument(
        "--alphas", nargs="+", type=float, default=[0.0, 0.3, 0.5, 0.7], help="alphas to decode at"
    )
    parser.add_argument("--cpu-threads", type=int, default=1)
    return parser.parse_args(argv)


def evaluate_at(best: Path, alpha: float, threads: int, folder: Path) -> dict[str, float]:
    """The test figures of `best` decoded at `alpha`, its threshold picked on validation."""
    state = checkpoint.load(best)
    if not checkpoint.config_of(state, best)["model"]["iou_score"]:
        raise DataError(f"{best} was trained without model.iou_score: there is no IoU to weigh")
    state.pop("operating_point", None)  # picked again, at this alpha
    copy = checkpoint.save(folder / "best.pth", state)
    out = folder / "eval.json"
    shipped = centernet.IOU_SCORE_ALPHA
    centernet.IOU_SCORE_ALPHA = alpha
    try:
        argv = ["--cpu-threads", str(threads), "evaluate", "--checkpoint", str(copy)]
        with contextlib.redirect_stdout(io.StringIO()):
            status = cli.main([*argv, "--out", str(out), "eval.score_threshold=null"])
    finally:
        centernet.IOU_SCORE_ALPHA = shipped
    if status:
        raise DataError(f"evaluating {best} at alpha {alpha} failed (exit {status})")
    metrics = json.loads(out.read_text(encoding="utf-8"))["metrics"]
    return {key: float(metrics[key]) for key in KEYS}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for path in sorted(args.records):
            record = json.loads(path.read_text(encoding="utf-8"))
            best = Path(record["work"]) / "run" / "best.pth"
            if not best.is_file():
                raise DataError(f"{path}: its run folder's {best} is gone")
            for alpha in args.alphas:
                figures = evaluate_at(best, alpha, args.cpu_threads, Path(folder))
                runs.append(
                    {
                        "record": str(path),
                        "seed": record["settings"]["seed"],
                        "alpha": alpha,
                        **figures,
                    }
                )
                print(f"seed {runs[-1]['seed']} alpha {alpha}: {figures}", flush=True)
    means = {
        alpha: {key: float(np.mean([r[key] for r in runs if r["alpha"] == alpha])) for key in KEYS}
        for alpha in args.alphas
    }
    print(
        harness.table(["alpha", *KEYS], [[f"{a} (mean)", *means[a].values()] for a in args.alphas])
    )
    figures = [
        harness.figure(
            f"alpha_{alpha}.{key}", f"alpha {alpha}: {key}, mean over runs", value, UNITS[key]
        )
        for alpha, row in means.items()
        for key, value in row.items()
    ]
    settings = {
        "set": args.set,
        "records": [str(p) for p in sorted(args.records)],
        "alphas": args.alphas,
        "shipped_alpha": centernet.IOU_SCORE_ALPHA,
    }
    harness.write_record(args, harness.record(NAME, figures, settings=settings))
    return harness.finish(
        args.out, {"benchmark": NAME, "settings": settings, "runs": runs}, True, False
    )


if __name__ == "__main__":
    harness.run(main)
