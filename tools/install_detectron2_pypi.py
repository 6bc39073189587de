"""Install detectron2's pure-Python part from the PyPI package ``sal-detectron2`` into this venv.

detectron2 is not on PyPI and has no wheels for recent torch; where its git host is unreachable
the only copy is ``sal-detectron2`` (a cp310 build of detectron2's 2024 main). Its Python code runs
on newer Pythons and torches once the compiled ``_C`` extension, built for another ABI, is removed:
detectron2 then falls back to torchvision ops, and COCO evaluation needs ``use_fast_impl=False``.

Steps: download the wheel for cp310 without dependencies into ``.venv/detectron2-pypi``, delete
``detectron2/_C*.so`` and the wheel's stray top-level ``tools`` package, put the folder on the
path with a ``.pth`` file, and install the runtime dependencies detectron2 imports.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

PACKAGE = "sal-detectron2==0.7.2"
# detectron2's own runtime requirements (its setup.py), minus torch and numpy<2 (only the deleted
# _C extension needs the old numpy ABI). setuptools<81 still ships pkg_resources, which
# detectron2.model_zoo imports.
RUNTIME_DEPS = [
    "setuptools<81",
    "Pillow>=7.1",
    "matplotlib",
    "pycocotools>=2.0.2",
    "termcolor>=1.1",
    "yacs>=0.1.8",
    "tabulate",
    "cloudpickle",
    "tqdm>4.29.0",
    "tensorboard",
    "fvcore",
    "iopath",
    "omegaconf>=2.1,<2.4",
    "hydra-core>=1.1",
    "black",
    "packaging",
]


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    venv = Path(sys.prefix)
    target = venv / "detectron2-pypi"
    if target.exists():
        shutil.rmtree(target)
    pip(
        "install",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.10",
        "--implementation",
        "cp",
        "--platform",
        "any",
        "--target",
        str(target),
        PACKAGE,
    )

    compiled = list((target / "detectron2").glob("_C*.so"))
    for so in compiled:
        so.unlink()
    shutil.rmtree(target / "tools", ignore_errors=True)  # would shadow any module named `tools`
    print(f"removed {[p.name for p in compiled]} and the wheel's top-level `tools` package")

    # Dependencies first: once the .pth exposes the wheel's metadata, pip would report its numpy<2.
    pip("install", *RUNTIME_DEPS)

    pth = Path(sysconfig.get_paths()["purelib"]) / "detectron2_pypi.pth"
    pth.write_text(f"{target}\n")
    print(f"wrote {pth} -> {target}")


if __name__ == "__main__":
    main()
