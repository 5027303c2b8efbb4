"""Registries of classes imported by name: the brokers' and the dialects' one mechanism.

A name resolves, in order, to a built-in (``package.module:Class``, imported
on first use so a user needs only the drivers they use), a class registered
at run time (:meth:`PluginRegistry.register`, for code that is not an
installed package), or an entry point of an installed package under the
registry's group (read from package metadata when asked, never at import).
Callers phrase their own errors from the exceptions below.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points

from outbox_core.errors import ConfigurationError


class PluginNotFound(LookupError):
    """No built-in, registered class or entry point has that name."""


class PluginImportFailed(ImportError):
    """The module of a built-in or registered class cannot be imported."""

    def __init__(self, target: str, *, builtin: bool, cause: ImportError) -> None:
        super().__init__(str(cause))
        self.target = target
        self.builtin = builtin
        self.cause = cause


class PluginBroken(Exception):
    """An installed package's entry point fails to load."""

    def __init__(self, where: str, cause: Exception) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.where = where


def is_dotted(target: str) -> bool:
    """``package.module:Class``."""
    module_name, sep, cls_name = target.partition(":")
    return bool(sep and module_name and cls_name)


@dataclass
class PluginRegistry:
    """Name -> class, from built-ins, run-time registrations and entry points."""

    #: What the classes are, for messages: ``broker``, ``dialect``.
    kind: str
    #: The entry-point group installed packages ship theirs under.
    group: str
    #: Built-in name -> ``package.module:Class``.
    builtins: dict[str, str]
    #: Name -> ``package.module:Class`` added by :meth:`register`.
    registered: dict[str, str] = field(default_factory=dict)

    def register(self, name: str, target: str, *, shown: str) -> None:
        """Serve ``name`` with the class at ``target``; a built-in cannot be replaced."""
        if not is_dotted(target):
            raise ConfigurationError(
                f"{self.kind} class must be 'package.module:Class', got {target!r}"
            )
        key = name.lower()
        if key in self.builtins and self.builtins[key] != target:
            raise ConfigurationError(f"{shown} is a built-in {self.kind} and cannot be replaced")
        self.registered[key] = target

    def installed(self) -> dict[str, EntryPoint]:
        """Installed packages' entry points of the group, by lower-case name."""
        found: dict[str, EntryPoint] = {}
        for entry in entry_points(group=self.group):
            found.setdefault(entry.name.lower(), entry)
        return found

    def known(self) -> list[str]:
        """Every name :meth:`resolve` accepts."""
        return sorted(set(self.builtins) | set(self.registered) | set(self.installed()))

    def resolve(self, name: str, *, dotted: bool = False) -> tuple[object, str]:
        """``(the object the name stands for, where it came from)``.

        ``dotted``: a ``package.module:Class`` name is imported as it is.
        Raises :class:`PluginNotFound`, :class:`PluginImportFailed` or
        :class:`PluginBroken`.
        """
        key = name.lower()
        target = self.builtins.get(key) or self.registered.get(key)
        if target is None and dotted and is_dotted(name):
            target = name
        if target is not None:
            module_name, _, cls_name = target.partition(":")
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:
                builtin = target in self.builtins.values()
                raise PluginImportFailed(target, builtin=builtin, cause=exc) from exc
            return getattr(module, cls_name, None), target
        entry = self.installed().get(key) if key else None
        if entry is None:
            raise PluginNotFound(name)
        dist = getattr(entry, "dist", None)
        origin = f"{dist.name} {dist.version}" if dist is not None else "an installed package"
        where = f"{entry.value} (entry point of {origin})"
        try:
            return entry.load(), where
        except Exception as exc:  # a broken plug-in: the caller says which one
            raise PluginBroken(where, exc) from exc
