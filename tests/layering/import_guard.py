"""Import modules with some imports forbidden, and report every forbidden attempt.

    PYTHONPATH=. python tests/layering/import_guard.py BLOCKED MODULE...   (repository root)

``BLOCKED`` is a comma-separated list of module names; a name blocks itself and
everything under it (``chatsvc.api`` blocks ``chatsvc.api.app``). ``NAME@SCOPE``
blocks ``NAME`` to the modules under ``SCOPE`` only (``chatsvc.engine@chatsvc.api``:
the API's own imports of the engine, while a module outside the API may load it).
``MODULE`` is a module to import, or ``pkg.*`` for every module file of a package.
An attempt is recorded even when the importing code catches the ImportError (an
optional import), so the guard sees every edge of the import graph that runs.
Prints one JSON object: the attempts (who imported what) and the modules that failed.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.abc
import importlib.util
import json
import pkgutil
import sys
import traceback


class Guard(importlib.abc.MetaPathFinder):
    def __init__(self, blocked: list[str]) -> None:
        self.blocked = blocked
        self.attempts: list[dict[str, str]] = []

    def find_spec(self, fullname, path=None, target=None):
        if any(fullname == name or fullname.startswith(name + ".") for name in self.blocked):
            importer = sys._getframe(1)
            # Walk out of importlib's own frames to the module whose code imported it.
            while importer is not None and importer.f_globals.get("__name__", "").startswith(
                ("importlib", "_frozen_importlib")
            ):
                importer = importer.f_back
            who = importer.f_globals.get("__name__", "?") if importer is not None else "?"
            self.attempts.append({"module": fullname, "imported_by": who})
            raise ImportError(f"{fullname} is forbidden here (tests/layering)")
        return None


def _under(module: str, name: str) -> bool:
    return module == name or module.startswith(name + ".")


class ScopedGuard:
    """Refuses ``name`` to the importers under ``scope``, for each ``(name, scope)`` rule.

    It wraps ``builtins.__import__``, which every import statement that runs goes
    through, also for a module already loaded (one a finder is never asked about
    again), so the rule holds however the name got loaded first.
    """

    def __init__(self, rules: list[tuple[str, str]], attempts: list[dict[str, str]]) -> None:
        self.rules = rules
        self.attempts = attempts
        self.original = builtins.__import__

    def __call__(self, name, globals=None, locals=None, fromlist=(), level=0):
        namespace = globals or {}
        importer = namespace.get("__name__", "?")
        target = name
        if level:
            package = namespace.get("__package__") or importer.rpartition(".")[0]
            target = importlib.util.resolve_name("." * level + name, package)
        # ``from pkg import mod`` names the module pkg.mod through its fromlist.
        targets = [target, *(f"{target}.{item}" for item in fromlist or () if item != "*")]
        for blocked, scope in self.rules:
            if not _under(importer, scope):
                continue
            for module in targets:
                if _under(module, blocked):
                    self.attempts.append({"module": module, "imported_by": importer})
                    raise ImportError(f"{module} is forbidden in {scope} (tests/layering)")
        return self.original(name, globals, locals, fromlist, level)


def expand(name: str) -> list[str]:
    if not name.endswith(".*"):
        return [name]
    package = importlib.import_module(name[:-2])
    found = [package.__name__]
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        found.append(info.name)
    return found


def main() -> None:
    names = [name for name in sys.argv[1].split(",") if name]
    blocked = [name for name in names if "@" not in name]
    guard = Guard(blocked)
    sys.meta_path.insert(0, guard)
    scoped = [tuple(name.split("@", 1)) for name in names if "@" in name]
    if scoped:
        builtins.__import__ = ScopedGuard(scoped, guard.attempts)
    for name in blocked:
        if name in sys.modules or any(m.startswith(name + ".") for m in sys.modules):
            raise SystemExit(f"{name} was imported before the guard was installed")
    failed: dict[str, str] = {}
    imported: list[str] = []
    for pattern in sys.argv[2:]:
        for name in expand(pattern):
            try:
                importlib.import_module(name)
                imported.append(name)
            except Exception:  # noqa: BLE001 - reported to the test
                failed[name] = traceback.format_exc(limit=3)
    # Where each imported top-level package came from: the checkout under test, not
    # an installed copy.
    origins = {}
    for name in imported:
        top = sys.modules[name.split(".")[0]]
        origins[top.__name__] = getattr(top, "__file__", None) or next(iter(top.__path__))
    report = {"attempts": guard.attempts, "failed": failed, "imported": imported}
    print(json.dumps({**report, "origins": origins}))


if __name__ == "__main__":
    main()
