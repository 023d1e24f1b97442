"""Installed as ``poros.registry_data``: the per-family TOML files beside this file (see ``poros.records``).

This file only makes the folder a regular package, so that ``importlib.resources.files()``
returns a plain directory in an installed wheel (for a namespace package it returns a
``MultiplexedPath``, whose ``str()`` is not a path).
"""
