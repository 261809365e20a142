"""Ship the top-level conf/ inside the wheel as elasticflow/conf/ (editable installs read conf/ in place)."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithConf(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "elasticflow" / "conf"
        shutil.copytree(Path(__file__).parent / "conf", target, dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildPyWithConf})
