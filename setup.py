"""Package discovery: three source folders install as one package, ``upipe_compile``.

``upipe_compile/`` is the package; ``passes/`` installs as ``upipe_compile.passes`` and
``integrations/torchtitan/`` as ``upipe_compile.integrations.torchtitan``. Every folder under
them is found here (namespace discovery: a folder without ``__init__.py`` is not missed), so a
new subpackage needs no list to be kept; everything else is in pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

SOURCE_FOLDERS = {
    "upipe_compile": "upipe_compile",
    "upipe_compile.passes": "passes",
    "upipe_compile.integrations.torchtitan": "integrations/torchtitan",
}


def packages_and_folders() -> tuple[list[str], dict[str, str]]:
    packages, folders = [], {}
    for package, folder in SOURCE_FOLDERS.items():
        folders[package] = folder
        packages.append(package)
        for sub in find_namespace_packages(folder, exclude=["*__pycache__*"]):
            packages.append(f"{package}.{sub}")
    return packages, folders


PACKAGES, PACKAGE_DIR = packages_and_folders()
setup(packages=PACKAGES, package_dir=PACKAGE_DIR)
