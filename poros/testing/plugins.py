"""Register a plugin for the length of one test, without installing it. Torch-free.

Plugin authors and Poros's own tests use it the way llm's test suite does::

    class LlamaPlugin:
        __name__ = "llama-test-plugin"

        @poros.hookimpl
        def poros_register_architectures(self, register):
            register(decoder_family(name="llama", display_name="Llama",
                                    model_types=("llama",), causal_lm_classes=("LlamaForCausalLM",)))

    def test_llama_is_found():
        with registered_plugin(LlamaPlugin()):
            assert poros.registry.get("LLAMA").name == "llama"

``poros.testing`` re-exports :func:`registered_plugin`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["builtin_families", "registered_plugin"]


@contextlib.contextmanager
def registered_plugin(plugin: Any, name: str | None = None) -> Iterator[str]:
    """Register ``plugin`` (a class instance or module with ``@poros.hookimpl`` methods) for a ``with`` block.

    The plugin joins the process-wide ``poros.registry.registry().plugin_manager`` after the
    installed plugins have loaded; the registrations cache is dropped on the way in and out, so
    lookups inside the block see the plugin's families and lookups after it do not.

    Args:
        plugin: the plugin object.
        name: plugin name shown by ``poros plugins``; default: the plugin's ``__name__``, else
            its class name.

    Yields:
        The name the plugin was registered under.

    Raises:
        PluginError: the plugin implements a hook that does not exist (e.g. a misspelled name);
            it is unregistered before the error propagates.
    """
    from poros.registry import registry

    reg = registry()
    reg.load_plugins()
    manager = reg.plugin_manager
    registered_name = manager.register(plugin, name=name or getattr(plugin, "__name__", None) or type(plugin).__name__)
    reg.invalidate()
    try:
        reg.check_pending()
        yield registered_name
    finally:
        manager.unregister(plugin)
        reg.invalidate()


def builtin_families() -> list[str]:
    """The built-in families in registration order: those the modules of ``poros.registry.DEFAULT_PLUGINS``
    register, what a listing shows before any third-party family. Asks each module's hook directly, so
    no registry is loaded."""
    import importlib

    from poros.registry import DEFAULT_PLUGINS

    names: list[str] = []
    for module in DEFAULT_PLUGINS:
        importlib.import_module(module).poros_register_architectures(register=lambda d: names.append(d.name))
    return names
