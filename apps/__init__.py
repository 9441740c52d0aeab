"""The apps, one package each (the commands over them live in tools/)."""

import pkgutil
from pathlib import Path

from lingua.app import App, load_app


def registered_apps() -> list[App]:
    """Every app shipped here: each package with a train.py, in name order."""
    return [load_app(info.name) for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name)
            if info.ispkg and (Path(info.module_finder.path) / info.name / "train.py").exists()]
