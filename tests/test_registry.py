"""The architecture registry: lookups, duplicate and unknown names, plugin loading. Torch-free."""

from __future__ import annotations

import string
import warnings
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import poros
from poros import registry
from poros.descriptor import decoder_family
from poros.errors import DuplicateArchitectureError, PluginError, UnknownArchitectureError
from poros.testing.plugins import registered_plugin

from conftest import BUILTIN_FAMILIES

REGISTERED = registry.architectures()
ALL_KEYS = sorted({key.lower() for r in REGISTERED for key in r.descriptor.all_names})

family_names = st.from_regex(r"[a-z][a-z0-9_]{1,12}", fullmatch=True).filter(lambda n: n not in ALL_KEYS)


def mixed_case(text: str) -> st.SearchStrategy[str]:
    """``text`` with each letter upper- or lower-cased independently."""
    return st.lists(st.booleans(), min_size=len(text), max_size=len(text)).map(
        lambda upper: "".join(c.upper() if u else c.lower() for c, u in zip(text, upper))
    )


def family(name: str, **fields) -> poros.ArchitectureDescriptor:
    fields.setdefault("model_types", (f"{name}_text",))
    return decoder_family(name=name, display_name=name.title(), causal_lm_classes=("TestForCausalLM",), **fields)


def test_builtin_families_register_through_the_plugin_path():
    by_name = {r.descriptor.name: r for r in registry.architectures()}
    for name in BUILTIN_FAMILIES:
        assert by_name[name].plugin == f"poros.families.{name}"
        assert by_name[name].distribution == "poros-train"


@settings(deadline=None)  # no timing in tests: a loaded CI machine must not fail them
@given(st.data())
def test_name_alias_and_model_type_lookups_agree_case_insensitively(data):
    registration = data.draw(st.sampled_from(REGISTERED), label="family")
    key = data.draw(st.sampled_from(registration.descriptor.all_names), label="key")
    spelled = data.draw(mixed_case(key), label="spelling")
    assert registry.get(spelled) is registration.descriptor
    assert registry.registration(spelled) == registration
    assert registry.for_config(SimpleNamespace(model_type=spelled)) is registration.descriptor


def test_for_config_falls_back_to_the_text_config():
    text_config = SimpleNamespace(model_type="gemma3_text")
    config = SimpleNamespace(model_type="some_vlm_wrapper", get_text_config=lambda: text_config)
    assert registry.for_config(config).name == "gemma3"


@settings(deadline=None)
@given(st.text(alphabet=string.ascii_letters + string.digits + "._-/ ", max_size=24))
def test_unknown_names_fail_listing_what_exists(name):
    from poros import records

    if name.lower() in ALL_KEYS or records.family_of_checkpoint(name):  # a name, or a known checkpoint id
        return
    with pytest.raises(UnknownArchitectureError) as failure:
        registry.get(name)
    message = str(failure.value)
    assert repr(name) in message
    for registration in REGISTERED:
        assert registration.descriptor.name in message
        assert all(model_type in message for model_type in registration.descriptor.model_types)
    assert "poros plugins" in message


@settings(max_examples=40, deadline=None)
@given(name=family_names, data=st.data())
def test_a_plugin_family_is_found_by_every_name_only_while_registered(family_plugin, name, data):
    descriptor = family(name, aliases=(f"{name}-alias",), model_types=(f"{name}_text", f"{name}_vl"))
    with registered_plugin(family_plugin(descriptor, name="plugin-under-test")):
        for key in descriptor.all_names:
            assert registry.get(data.draw(mixed_case(key))) is descriptor
        registration = registry.registration(name)
        assert registration.plugin == "plugin-under-test"
        assert [r.descriptor.name for r in registry.architectures()][-1] == name
    with pytest.raises(UnknownArchitectureError):
        registry.get(name)
    assert registry.architectures() == REGISTERED


@settings(max_examples=60, deadline=None)
@given(data=st.data(), new_name=family_names)
def test_duplicate_name_alias_or_model_type_names_both_plugins_and_the_fix(family_plugin, data, new_name):
    existing = data.draw(st.sampled_from(REGISTERED), label="existing")
    how = data.draw(st.sampled_from(["name", "alias", "model_type"]), label="collides by")
    taken = data.draw(mixed_case(data.draw(st.sampled_from(existing.descriptor.all_names))), label="taken key")
    if how == "name":
        descriptor = family(existing.descriptor.name)
        taken = existing.descriptor.name
    elif how == "alias":
        descriptor = family(new_name, aliases=(taken,))
    else:
        descriptor = family(new_name, model_types=(taken,))

    with registered_plugin(family_plugin(descriptor, name="intruder-plugin")):
        for _ in range(2):  # a failed registration must not leave a half-filled index behind
            with pytest.raises(DuplicateArchitectureError) as failure:
                registry.architectures()
            message = str(failure.value)
            assert repr(taken) in message
            assert existing.plugin in message and "intruder-plugin" in message
            assert existing.descriptor.name in message and descriptor.name in message
            assert "Rename" in message and registry.LOAD_PLUGINS_ENV in message
    assert registry.architectures() == REGISTERED


def test_registering_something_else_than_a_descriptor_names_the_plugin():
    class Sloppy:
        __name__ = "sloppy-plugin"

        @poros.hookimpl
        def poros_register_architectures(self, register):
            register({"name": "llama"})

    with registered_plugin(Sloppy()), pytest.raises(PluginError, match="sloppy-plugin.*dict.*decoder_family"):
        registry.architectures()


def test_check_pending_rejects_a_misspelled_hook():
    class Misspelled:
        __name__ = "misspelled-plugin"

        @poros.hookimpl
        def poros_register_architecture(self, register):  # missing the final "s"
            raise AssertionError("never called")

    plugin = Misspelled()
    with pytest.raises(PluginError) as failure:
        with registered_plugin(plugin):
            pass
    message = str(failure.value)
    assert "poros_register_architecture" in message and "misspelled-plugin" in message
    assert "poros_register_architectures" in message and "rename" in message  # the hooks that exist, the fix
    assert not registry.registry().plugin_manager.is_registered(plugin)
    registry.registry().check_pending()  # and nothing stays behind to fail later


# -- POROS_LOAD_PLUGINS, on a fresh registry with fake entry points --------------------------

def fake_entry_point(name: str, distribution: str, plugin=None, error: Exception | None = None):
    def load():
        if error is not None:
            raise error
        return plugin

    return SimpleNamespace(name=name, dist=SimpleNamespace(name=distribution, version="9.9"), load=load)


@pytest.fixture
def entry_points(monkeypatch, family_plugin):
    """Two installed entry-point plugins, ``alpha`` (dist ``poros-alpha``) and ``beta`` (dist ``poros-beta``)."""
    installed = [
        fake_entry_point("alpha", "poros-alpha", family_plugin(family("alpha"), name="alpha")),
        fake_entry_point("beta", "poros-beta", family_plugin(family("beta"), name="beta")),
    ]

    def entry_points(group):
        assert group == registry.ENTRY_POINT_GROUP
        return list(installed)

    monkeypatch.setattr(registry.importlib.metadata, "entry_points", entry_points)
    monkeypatch.delenv(registry.LOAD_PLUGINS_ENV, raising=False)
    return installed


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        (None, ["alpha", "beta"]),  # unset: every entry point
        ("", []),  # empty: built-ins only
        ("alpha", ["alpha"]),  # by entry-point name
        ("poros-beta", ["beta"]),  # by distribution name
        (" beta , alpha ,", ["alpha", "beta"]),  # spaces and trailing commas ignored
        ("gamma", []),  # a name nobody provides loads nothing
    ],
    ids=["unset", "empty", "entry-point", "distribution", "list", "unknown"],
)
def test_load_plugins_env_selects_entry_points(entry_points, monkeypatch, setting, expected):
    if setting is not None:
        monkeypatch.setenv(registry.LOAD_PLUGINS_ENV, setting)
    fresh = registry.ArchitectureRegistry()
    names = list(fresh.registrations())
    assert names[: len(BUILTIN_FAMILIES)] == list(BUILTIN_FAMILIES)
    assert names[len(BUILTIN_FAMILIES):] == expected
    for name in expected:
        assert fresh.get(name).provider == f"poros-{name} 9.9"


def test_a_broken_entry_point_is_reported_and_skipped(entry_points):
    entry_points.insert(0, fake_entry_point("broken", "poros-broken", error=ImportError("no module named 'llama_ext'")))
    fresh = registry.ArchitectureRegistry()
    with pytest.warns(UserWarning, match="'broken' from poros-broken failed to load.*POROS_LOAD_PLUGINS"):
        names = list(fresh.registrations())
    assert names[-2:] == ["alpha", "beta"]
    assert fresh.load_errors == [("broken", "ImportError: no module named 'llama_ext'")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.registrations()  # loads once: no second warning
