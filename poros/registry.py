"""The architecture registry: a pluggy ``PluginManager("poros")`` and lookups over what it registered.

Built-in families are ordinary plugins (the modules in :data:`DEFAULT_PLUGINS`), registered
through the same hook as third-party packages, which declare an entry point in the group
``poros``::

    [project.entry-points.poros]
    my_family = "my_package.poros_plugin"

Loading is lazy (first lookup), once, and strict (``check_pending()`` rejects a misspelled hook).
``POROS_LOAD_PLUGINS`` limits which entry-point plugins load: unset loads all of them; an empty
string loads only the built-ins; ``a,b`` loads the entry points or distributions named.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import warnings
from dataclasses import dataclass
from typing import Any, Iterable

import pluggy

from poros import hookspecs
from poros.descriptor import ArchitectureDescriptor, validate
from poros.errors import DuplicateArchitectureError, PluginError, UnknownArchitectureError

ENTRY_POINT_GROUP = "poros"
LOAD_PLUGINS_ENV = "POROS_LOAD_PLUGINS"
DEFAULT_PLUGINS = (
    "poros.families.qwen2",
    "poros.families.qwen3",
    "poros.families.qwen3_5",
    "poros.families.qwen3_5_moe",
    "poros.families.gemma3",
    "poros.families.gemma4",
)


@dataclass(frozen=True)
class Registration:
    """One registered family and who provided it."""

    descriptor: ArchitectureDescriptor
    plugin: str
    distribution: str
    version: str

    @property
    def provider(self) -> str:
        return f"{self.distribution} {self.version}"


class ArchitectureRegistry:
    """Owns the plugin manager and the index of registered families.

    Use the module-level functions (:func:`get`, :func:`architectures`, ...) rather than this class;
    tests use :func:`poros.testing.registered_plugin` to add a plugin for one test.
    """

    def __init__(self) -> None:
        self.plugin_manager = pluggy.PluginManager("poros")
        self.plugin_manager.add_hookspecs(hookspecs)
        self._plugins_loaded = False
        self._registrations: dict[str, Registration] | None = None
        self._index: dict[str, str] = {}
        self.load_errors: list[tuple[str, str]] = []
        self._distributions: dict[str, tuple[str, str]] = {}

    # -- loading ---------------------------------------------------------------------------
    def load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for module_name in DEFAULT_PLUGINS:
            self.plugin_manager.register(importlib.import_module(module_name), name=module_name)
        wanted = os.environ.get(LOAD_PLUGINS_ENV)
        selected = None if wanted is None else {w.strip() for w in wanted.split(",") if w.strip()}
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist_name = entry_point.dist.name if entry_point.dist else ""
            if selected is not None and entry_point.name not in selected and dist_name not in selected:
                continue
            if self.plugin_manager.get_plugin(entry_point.name) is not None:
                continue
            try:
                plugin = entry_point.load()
            except Exception as exc:  # a broken third-party plugin must not break poros
                message = f"{type(exc).__name__}: {exc}"
                self.load_errors.append((entry_point.name, message))
                warnings.warn(
                    f"poros plugin {entry_point.name!r} from {dist_name or '?'} failed to load ({message}); "
                    f"skipping it. Reinstall or remove that package, or set {LOAD_PLUGINS_ENV}= to load built-ins only.",
                    stacklevel=2,
                )
                continue
            self.plugin_manager.register(plugin, name=entry_point.name)
            self._distributions[entry_point.name] = (dist_name, entry_point.dist.version if entry_point.dist else "?")
        self.check_pending()

    def check_pending(self) -> None:
        try:
            self.plugin_manager.check_pending()
        except pluggy.PluginValidationError as exc:
            name = self.plugin_manager.get_name(exc.plugin) or repr(exc.plugin)
            distribution, version = self.provider_of(name)
            raise PluginError(
                f"plugin {name!r} ({distribution} {version}): {exc}. Every hook a plugin implements must be "
                f"one of: {', '.join(hook_names())}; rename the function (hooks are prefixed 'poros_')."
            ) from exc

    def provider_of(self, plugin_name: str) -> tuple[str, str]:
        """``(distribution, version)`` that provides a plugin; built-ins are ``poros-train``."""
        if plugin_name in DEFAULT_PLUGINS:
            return "poros-train", _own_version()
        if plugin_name in self._distributions:
            return self._distributions[plugin_name]
        plugin = self.plugin_manager.get_plugin(plugin_name)
        module = getattr(plugin, "__module__", None) or getattr(plugin, "__name__", "")
        return (module.split(".")[0] or plugin_name), "-"

    # -- registration ----------------------------------------------------------------------
    def registrations(self) -> dict[str, Registration]:
        if self._registrations is None:
            self.load_plugins()
            self._registrations, self._index = {}, {}
            hook = self.plugin_manager.hook.poros_register_architectures
            # Call each implementation with its own `register`, so a duplicate names both plugins.
            try:
                for impl in hook.get_hookimpls():
                    impl.function(register=self._register_callback(impl.plugin_name))
            except BaseException:
                self.invalidate()  # never serve a half-filled index after a failed registration
                raise
        return self._registrations

    def _register_callback(self, plugin_name: str):
        def register(descriptor: ArchitectureDescriptor) -> None:
            if not isinstance(descriptor, ArchitectureDescriptor):
                raise PluginError(
                    f"plugin {plugin_name!r} registered {type(descriptor).__name__}, expected an "
                    "ArchitectureDescriptor; build one with poros.descriptor.decoder_family(...)."
                )
            problems = validate(descriptor)
            if problems:
                raise PluginError(f"plugin {plugin_name!r}: descriptor {descriptor.name!r}: " + "; ".join(problems))
            assert self._registrations is not None
            for key in descriptor.all_names:
                owner = self._index.get(key.lower())
                if owner is not None:
                    other = self._registrations[owner]
                    raise DuplicateArchitectureError(
                        f"{key!r} is claimed twice: by family {other.descriptor.name!r} from plugin "
                        f"{other.plugin!r} ({other.provider}) and by family {descriptor.name!r} from plugin "
                        f"{plugin_name!r}. Rename the new family or drop the alias/model type, or uninstall "
                        f"one plugin (or list only one in {LOAD_PLUGINS_ENV})."
                    )
            distribution, version = self.provider_of(plugin_name)
            self._registrations[descriptor.name] = Registration(descriptor, plugin_name, distribution, version)
            for key in descriptor.all_names:
                self._index[key.lower()] = descriptor.name

        return register

    def invalidate(self) -> None:
        """Forget registered families; the next lookup calls the hooks again."""
        self._registrations = None
        self._index = {}

    # -- lookup ----------------------------------------------------------------------------
    def get(self, name: str) -> Registration:
        registrations = self.registrations()
        key = self._index.get(str(name).lower())
        if key is None:
            from poros import records  # torch-free; maps known checkpoint ids to families

            family = records.family_of_checkpoint(str(name))
            key = self._index.get(family.lower()) if family else None
        if key is None:
            known = ", ".join(
                f"{r.descriptor.name} ({'/'.join(r.descriptor.model_types)})" for r in registrations.values()
            )
            raise UnknownArchitectureError(
                f"no registered architecture is called {name!r}. Registered: {known}. "
                "Use one of these names or HF model types, or install a plugin that provides the "
                "family (see `poros plugins` and docs/plugins.md)."
            )
        return registrations[key]


_REGISTRY: ArchitectureRegistry | None = None


def registry() -> ArchitectureRegistry:
    """The process-wide registry (created on first use)."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = ArchitectureRegistry()
    return _REGISTRY


def plugin_manager() -> pluggy.PluginManager:
    reg = registry()
    reg.load_plugins()
    return reg.plugin_manager


def architectures() -> list[Registration]:
    """Every registered family, in registration order (built-ins first)."""
    return list(registry().registrations().values())


def get(name: str) -> ArchitectureDescriptor:
    """Descriptor by family name, alias, HF ``model_type`` or known checkpoint id (case-insensitive).

    Raises:
        UnknownArchitectureError: nothing matches; the message lists what is registered.
    """
    return registry().get(name).descriptor


def registration(name: str) -> Registration:
    return registry().get(name)


def for_config(config: Any) -> ArchitectureDescriptor:
    """Descriptor for an HF config, by ``config.model_type`` (then its text config's)."""
    types = [getattr(config, "model_type", None)]
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        types.append(getattr(get_text_config(), "model_type", None))
    for model_type in types:
        if model_type and model_type.lower() in _index():
            return get(model_type)
    return get(next((t for t in types if t), "<no model_type>"))


def _index() -> dict[str, str]:
    registry().registrations()
    return registry()._index


def hook_names() -> list[str]:
    return sorted(name for name in dir(hookspecs) if name.startswith("poros_"))


def plugin_listing() -> list[dict[str, Any]]:
    """Loaded plugins: name, distribution, version, hooks implemented, families registered."""
    reg = registry()
    regs = reg.registrations()
    rows = []
    for name, plugin in reg.plugin_manager.list_name_plugin():
        distribution, version = reg.provider_of(name)
        rows.append({
            "name": name,
            "distribution": distribution,
            "version": version,
            "builtin": name in DEFAULT_PLUGINS,
            "hooks": sorted(h.name for h in reg.plugin_manager.get_hookcallers(plugin) or []),
            "families": [r.descriptor.name for r in regs.values() if r.plugin == name],
        })
    return rows


def _own_version() -> str:
    try:
        return importlib.metadata.version("poros-train")
    except importlib.metadata.PackageNotFoundError:
        from poros import __version__

        return __version__


def iter_descriptors() -> Iterable[ArchitectureDescriptor]:
    return (r.descriptor for r in architectures())
