"""The apps, one package each (the commands over them live in tools/)."""

from lingua.app import App, load_app, shipped_apps


def registered_apps() -> list[App]:
    """Every app shipped here: each package with a train.py, in name order."""
    return [load_app(name) for name in shipped_apps()]
