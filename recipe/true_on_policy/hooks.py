"""Post-import hooks and the one patch helper; imports no host (verl, vLLM, Megatron).

``after_import``: run a callback right after a host module has executed. Registrations
that need a heavy verl module (the FSDP engine imports transformers and FSDP: seconds of
CPU) must not import it themselves: ``register`` runs in every process
that imports verl, vLLM workers included. ``after_import`` defers them to the moment
verl imports the module on its own, and — since it runs before any importer reads the
module's attributes — a function replaced there is seen by ``from module import name``.
"""
import importlib.abc
import importlib.util
import sys

_pending: dict[str, list] = {}


class _CallbackLoader(importlib.abc.Loader):
    """Wraps a module's loader; runs the callbacks once the module has executed."""

    def __init__(self, loader, callbacks):
        self._loader, self._callbacks = loader, callbacks

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for callback in self._callbacks:
            callback(module)

    def __getattr__(self, name):  # get_source, get_resource_reader, ...
        return getattr(self._loader, name)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """First on sys.meta_path; finds a pending module with the other finders and wraps
    its loader. Popping the name first keeps that lookup from coming back here."""

    def find_spec(self, fullname, path, target=None):
        callbacks = _pending.pop(fullname, None)
        if not callbacks:
            return None
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _CallbackLoader(spec.loader, callbacks)
        return spec


def after_import(name: str, callback) -> None:
    """Run ``callback(module)`` now if ``name`` is imported, else right after its import.
    Idempotent: the same callback is queued once."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    queued = _pending.setdefault(name, [])
    if callback not in queued:
        queued.append(callback)
    if not any(isinstance(f, _AfterImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImportFinder())


MARK = "_true_on_policy"   # set on every replacement we install


def patch(owner, name: str, make):
    """Replace ``owner.name`` by ``make(current)``, once: a second call (or a process that
    already holds our replacement) changes nothing. Returns what is in place."""
    current = getattr(owner, name)
    if getattr(current, MARK, False):
        return current
    replacement = make(current)
    setattr(replacement, MARK, True)
    setattr(owner, name, replacement)
    return replacement
