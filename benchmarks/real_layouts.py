"""Reading a fetched detection set (a bare git mirror or a folder) and laying it out as a
real export is laid out: Pascal VOC (Annotations/, JPEGImages/, ImageSets/Main/<split>.txt)
or COCO with one folder per split. benchmarks/real_sets.py says which set takes which.
"""

from __future__ import annotations

import json
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

from pipeline.errors import DataError

SPLITS = ("train", "val", "test")


# ---- reading a fetched set -------------------------------------------------------------
def git_dir(path: Path) -> Path | None:
    """The git directory of a bare mirror at `path` (or at `path`/repo, as fetched), if any."""
    for candidate in (path, path / "repo"):
        if (candidate / "HEAD").is_file() and (candidate / "objects").is_dir():
            return candidate
    return None


class Source:
    """A fetched set's files by relative POSIX path: a bare git mirror at HEAD, or a folder.

    A mirror may lack the blobs of files no set needs (large model files, say), so only the
    files asked for are read.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.git = git_dir(path)
        if self.git is None and not path.is_dir():
            raise DataError(f"--source {path} is neither a folder nor a bare git mirror.")
        if self.git is not None:
            self.names = self._git(["ls-tree", "-r", "-z", "--name-only", "HEAD"]).split("\0")
            self._reader = subprocess.Popen(
                ["git", f"--git-dir={self.git}", "cat-file", "--batch"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
        else:
            self.names = [p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()]
        self.names = sorted(name for name in self.names if name)
        self._listed = set(self.names)

    def _git(self, args: list[str]) -> str:
        try:
            done = subprocess.run(
                ["git", f"--git-dir={self.git}", *args], capture_output=True, text=True, check=False
            )
        except OSError as error:
            raise DataError(f"Reading the bare mirror {self.git} needs git: {error}.") from error
        if done.returncode != 0:
            raise DataError(f"git {' '.join(args)} in {self.git} failed: {done.stderr.strip()}")
        return done.stdout

    def under(self, folder: str) -> list[str]:
        """Files directly inside `folder` (no sub-folders)."""
        prefix = f"{folder}/"
        return [n for n in self.names if n.startswith(prefix) and "/" not in n[len(prefix) :]]

    def has(self, name: str) -> bool:
        return name in self._listed

    def read(self, name: str) -> bytes:
        if not self.has(name):
            raise DataError(f"{self.path} has no file {name}: is it a fetch of this set?")
        if self.git is None:
            try:
                return (self.path / name).read_bytes()
            except OSError as error:
                raise DataError(f"{self.path / name} cannot be read: {error}.") from error
        self._reader.stdin.write(f"HEAD:{name}\n".encode())
        self._reader.stdin.flush()
        header = self._reader.stdout.readline().decode().split()
        if len(header) != 3 or header[1] != "blob":
            raise DataError(
                f"{self.git} lists {name} but does not hold its content ({' '.join(header)}): "
                "fetch the mirror again."
            )
        content = self._reader.stdout.read(int(header[2]))
        self._reader.stdout.read(1)  # the newline after each object
        return content

    def close(self) -> None:
        if self.git is not None:
            self._reader.stdin.close()
            self._reader.wait()


# ---- laying a set out ------------------------------------------------------------------
def seeded_split(ids: list[str], seed: int, val: float, test: float) -> dict[str, list[str]]:
    """Shuffle the sorted ids with `seed`; the first share is test, the next val, the rest train
    (a share above 0 gets at least one image)."""
    order = [ids[i] for i in np.random.default_rng(seed).permutation(len(ids))]
    n_test, n_val = (max(1, round(share * len(ids))) if share else 0 for share in (test, val))
    return {
        "test": sorted(order[:n_test]),
        "val": sorted(order[n_test : n_test + n_val]),
        "train": sorted(order[n_test + n_val :]),
    }


def published_split(source: Source, seed: int) -> dict[str, list[str]]:
    """ImageSets/Main/{train,val,test}.txt as published, made disjoint.

    Test is what the figures are reported on, so it is kept whole. Where the published val
    shares images with test, the best operating point and best.pth would be chosen on test
    images: validation then becomes a seeded 10% of train instead.
    """
    lists = {}
    for split in SPLITS:
        text = source.read(f"ImageSets/Main/{split}.txt").decode()
        lists[split] = sorted({line.split()[0] for line in text.splitlines() if line.strip()})
    leaked = sorted(set(lists["train"]) & (set(lists["val"]) | set(lists["test"])))
    if leaked:
        raise DataError(
            f"{source.path}: ImageSets/Main/train.txt shares {len(leaked)} image(s) with val or "
            f"test ({', '.join(leaked[:3])}): no disjoint split can be made of it."
        )
    shared = set(lists["val"]) & set(lists["test"])
    if shared:
        carved = seeded_split(lists["train"], seed, val=0.1, test=0.0)
        print(
            f"ImageSets/Main/val.txt: {len(shared)} of its {len(lists['val'])} images are also "
            f"in test.txt; validation is a seeded 10% of train.txt instead ({len(carved['val'])} "
            f"images), test.txt is kept whole ({len(lists['test'])})"
        )
        lists["train"], lists["val"] = carved["train"], carved["val"]
    return lists


def write_file(path: Path, content: bytes) -> None:
    """Write a file of the set; a second, different file of the same name is an error."""
    if path.exists():
        if path.read_bytes() != content:
            raise DataError(f"Two different files would both become {path}.")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)


def lay_out_voc(
    source: Source,
    out: Path,
    annotations: str,
    image_folders: tuple[str, ...],
    splits: dict[str, list[str]],
) -> None:
    """Annotations/<id>.xml, JPEGImages/<the XML's filename>, ImageSets/Main/<split>.txt."""
    copies_of: dict[str, list[str]] = {}  # an image's file name -> where the source has it
    for folder in image_folders:
        for name in source.under(folder):
            copies_of.setdefault(name.rsplit("/", 1)[1], []).append(name)
    for split, ids in splits.items():
        for image_id in ids:
            if not source.has(f"{annotations}/{image_id}.xml"):
                raise DataError(
                    f"The {split} split lists {image_id}, but {source.path} has no "
                    f"{annotations}/{image_id}.xml."
                )
            xml = source.read(f"{annotations}/{image_id}.xml")
            try:
                file_name = ET.fromstring(xml).findtext("filename") or f"{image_id}.jpg"
            except ET.ParseError as error:
                raise DataError(
                    f"{annotations}/{image_id}.xml is not valid XML: {error}."
                ) from error
            copies = copies_of.get(file_name, [])
            if not copies:
                raise DataError(
                    f"{annotations}/{image_id}.xml names image {file_name}, which is in none of "
                    f"{', '.join(image_folders)} of {source.path}."
                )
            write_file(out / "Annotations" / f"{image_id}.xml", xml)
            for copy in copies:  # identical duplicates collapse; different ones stop
                write_file(out / "JPEGImages" / file_name, source.read(copy))
        listing = out / "ImageSets" / "Main" / f"{split}.txt"
        listing.parent.mkdir(parents=True, exist_ok=True)
        listing.write_text("".join(f"{image_id}\n" for image_id in ids), encoding="utf-8")


def lay_out_coco_per_split(source: Source, out: Path, folders: tuple[str, ...]) -> None:
    """Each split folder's _annotations.coco.json and the images it names, beside it."""
    for folder in folders:
        name = f"{folder}/_annotations.coco.json"
        document = source.read(name)
        try:
            files = [image["file_name"] for image in json.loads(document)["images"]]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise DataError(f"{source.path}/{name} is not a COCO file: {error}.") from error
        write_file(out / name, document)
        for file_name in files:
            if not source.has(f"{folder}/{file_name}"):
                raise DataError(f"{source.path}/{name} names {file_name}, which is not beside it.")
            write_file(out / folder / file_name, source.read(f"{folder}/{file_name}"))
