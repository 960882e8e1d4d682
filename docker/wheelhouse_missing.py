"""Requirements the image's Python needs that a wheelhouse lacks (scripts/build-cpu-image.sh).

``pip wheel`` on the host evaluates environment markers for the host's Python, which may differ
from the image's in the patch release (``redis`` needs ``async-timeout`` below Python 3.11.3, and
Debian bookworm has 3.11.2). This re-evaluates every wheel's ``Requires-Dist`` for the image's
version and prints what no wheel in the folder satisfies, one requirement a line.

usage: python wheelhouse_missing.py WHEELHOUSE PYTHON_VERSION REQUIREMENTS_FILE
"""

import sys
import zipfile
from pathlib import Path

from pip._vendor.packaging.markers import default_environment
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename


def missing(wheels: Path, python_version: str, requirements: Path) -> list[str]:
    env = {
        **default_environment(),
        "python_full_version": python_version,
        "python_version": ".".join(python_version.split(".")[:2]),
        "extra": "",
    }
    have = {}
    needed = [Requirement(line) for line in requirements.read_text().splitlines() if line.strip()]
    for whl in wheels.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(whl.name)
        have[name] = version
        with zipfile.ZipFile(whl) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            for line in z.read(meta).decode().splitlines():
                if line.startswith("Requires-Dist:"):
                    needed.append(Requirement(line.split(":", 1)[1].strip()))
    out = set()
    for req in needed:
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        if name not in have or not req.specifier.contains(have[name], prereleases=True):
            out.add(f"{req.name}{req.specifier}")
    return sorted(out)


if __name__ == "__main__":
    for requirement in missing(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])):
        print(requirement)
