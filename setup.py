"""Build hook only (the metadata is in pyproject.toml): the wheel carries the recipes and the shipped models.

`configs/` and `assets/` are copied into the built package as `mmgrpo/_data/{configs,assets}`, so an installed
mmgrpo resolves `mmgrpo train shapes_t2i` and the recipe's `assets/...` paths (mmgrpo/recipes.py) without this
repository. An editable install needs no copy: it finds them in the checkout.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED = ("configs", "assets")
SKIP = shutil.ignore_patterns("__pycache__", ".*", "*.tmp", "*.pyc")


class BuildWithShippedData(build_py):
    """build_py, then copy configs/ and assets/ into <build_lib>/mmgrpo/_data/."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for name in SHIPPED:
            source, target = ROOT / name, Path(self.build_lib) / "mmgrpo" / "_data" / name
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(source, target, ignore=SKIP)


setup(cmdclass={"build_py": BuildWithShippedData})
