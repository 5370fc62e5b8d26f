"""Model configs shipped with the package (shapes only, no weights).

Each preset is a ``<name>.json`` file in this package, read with
``importlib.resources`` so it works from a wheel, an sdist or a zip.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any


def list_presets() -> list[str]:
    """Names of the shipped presets, sorted (``tiny``, ``gpt-oss-20b``, ...)."""
    root = resources.files(__name__)
    return sorted(p.name[: -len(".json")] for p in root.iterdir() if p.name.endswith(".json"))


def minifleet_presets() -> list[str]:
    """The presets ``fdfleet verify`` and ``fdfleet modeldir`` build (``model_type`` ``minifleet``),
    sorted; the others are shapes of real models for ``fdfleet plan``."""
    return [name for name in list_presets() if load_preset(name).get("model_type") == "minifleet"]


def load_preset(name: str) -> dict[str, Any]:
    """The config dict of preset ``name`` (a trailing ``.json`` is accepted)."""
    if not isinstance(name, str):
        raise TypeError(f"preset name must be a string, got {type(name).__name__} {name!r}")
    stem = name[: -len(".json")] if name.endswith(".json") else name
    names = list_presets()
    if stem not in names:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(names)}")
    text = resources.files(__name__).joinpath(f"{stem}.json").read_text(encoding="utf-8")
    return json.loads(text)
