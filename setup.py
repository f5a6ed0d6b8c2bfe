"""One distribution, one import name: ``halfmoon``, whose library lives in shared/halfmoon/ and whose
services live in services/halfmoon/services/ (the design card's top-level folders)."""

from setuptools import find_namespace_packages, setup

setup(
    packages=find_namespace_packages("shared", include=["halfmoon", "halfmoon.*"])
    + find_namespace_packages("services", include=["halfmoon.services", "halfmoon.services.*"]),
    package_dir={"": "shared", "halfmoon.services": "services/halfmoon/services"},
)
