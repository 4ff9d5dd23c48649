"""Package discovery only; everything else is in pyproject.toml.

``pytest_plugin/`` and ``checkers/`` are top-level folders (the design card fixes them) that install as
``msprobe_ci.pytest_plugin`` and ``msprobe_ci.checkers`` (pyproject.toml's package-dir). setuptools' own discovery
in pyproject.toml cannot follow such a mapping, so the packages are found here with ``find_packages``: every
package under ``msprobe_ci/`` and under each mapped folder ships, whatever is added later.
"""

from setuptools import find_packages, setup

MAPPED = {"msprobe_ci.pytest_plugin": "pytest_plugin", "msprobe_ci.checkers": "checkers"}

packages = find_packages(include=["msprobe_ci", "msprobe_ci.*"])
for name, folder in MAPPED.items():
    packages += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]

setup(packages=sorted(packages), package_dir=MAPPED)
