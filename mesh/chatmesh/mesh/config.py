"""Configuration: every setting is a `CHATMESH_*` environment variable and a command-line flag.

Each service declares its settings next to its code (a `settings.py` module listed in `SETTING_MODULES`);
`all_settings()` collects them for the CLI and for the README's table (a test keeps the two in step).
Precedence: flag, then environment, then the declared default.

What a process read: every setting a `Config` resolves is recorded (process-wide, by variable name), so
`unread(env)` names the `CHATMESH_*` variables a process was given and never looked at - a misspelled, stale or
another service's setting. `chatmesh serve` logs them once the service is up (`settings_unread`), and the deploy
tests use the same record to check that each container's environment is exactly what its service reads.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")

SETTING_MODULES = (
    "chatmesh.mesh.settings",
    "chatmesh.model.settings",
    "chatmesh.store.settings",
    "chatmesh.router.settings",
    "chatmesh.engine_adapter.settings",
    "chatmesh.engine_adapter.local.settings",
    "chatmesh.engine_adapter.triton.settings",
    "chatmesh.moderation.settings",
    "chatmesh.chat.settings",
    "chatmesh.gateway.settings",
)

_REGISTRY: dict[str, Setting[Any]] = {}
_READ: set[str] = set()  # every setting any Config of this process has resolved


class SettingRefused(ValueError):
    """A setting's value a service cannot run with, found while it builds; `chatmesh serve` logs the message as
    `startup_refused` and exits 2 (no traceback)."""


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {text!r}")


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One setting: its environment variable, default, meaning, and how to parse its text."""

    env: str
    default: T
    help: str
    parse: Callable[[str], T]
    choices: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.env.startswith("CHATMESH_"):
            raise ValueError(f"setting {self.env} must start with CHATMESH_")
        _REGISTRY[self.env] = self

    @property
    def flag(self) -> str:
        return "--" + self.env.removeprefix("CHATMESH_").lower().replace("_", "-")

    @property
    def dest(self) -> str:
        return self.env.removeprefix("CHATMESH_").lower()

    def read(self, env: Mapping[str, str], flags: Mapping[str, str | None]) -> T:
        raw = flags.get(self.dest)
        if raw is None:
            raw = env.get(self.env)
        if raw is None:
            # A text default goes through the parser too (e.g. "~/..." expanded); typed defaults are final.
            return self.parse(self.default) if isinstance(self.default, str) else self.default
        if self.choices and raw not in self.choices:
            raise ValueError(f"{self.env} must be one of {', '.join(self.choices)}, got {raw!r}")
        try:
            return self.parse(raw)
        except ValueError as err:
            raise ValueError(f"{self.env}: {err}") from None


def settings_of(module: str) -> list[Setting[Any]]:
    """The settings one settings module declares (at its top level, or as the values of a dict there)."""
    found: dict[str, Setting[Any]] = {}
    for value in vars(importlib.import_module(module)).values():
        for item in value.values() if isinstance(value, dict) else (value,):
            if isinstance(item, Setting):
                found[item.env] = item
    return sorted(found.values(), key=lambda s: s.env)


def all_settings() -> list[Setting[Any]]:
    for module in SETTING_MODULES:
        importlib.import_module(module)
    return sorted(_REGISTRY.values(), key=lambda s: s.env)


class Config:
    """Resolved values of every setting, read once at start-up."""

    def __init__(self, env: Mapping[str, str] | None = None, flags: Mapping[str, str | None] | None = None):
        self._env = dict(os.environ if env is None else env)
        self._flags = dict(flags or {})
        self._cache: dict[str, Any] = {}

    def __getitem__(self, setting: Setting[T]) -> T:
        if setting.env not in self._cache:
            self._cache[setting.env] = setting.read(self._env, self._flags)
            _READ.add(setting.env)
        value: T = self._cache[setting.env]
        return value

    def unread(self) -> list[str]:
        """The CHATMESH_* variables of this Config's environment that no Config of this process has read."""
        return sorted(k for k in self._env if k.startswith("CHATMESH_") and k not in _READ)

    def as_env(self, settings: Iterable[Setting[Any]]) -> dict[str, str]:
        """The resolved values as environment variables, to hand to a child process."""
        out = {k: v for k, v in self._env.items() if k.startswith("CHATMESH_")}
        for s in settings:
            raw = self._flags.get(s.dest)
            if raw is not None:
                out[s.env] = raw
        return out


def read_so_far() -> frozenset[str]:
    """The settings (variable names) this process has resolved through any Config."""
    return frozenset(_READ)


# What a command's help shows: each service's setting modules (the mesh's shared ones first), for
# `add_flags(parser, *SERVICE_SETTINGS[service])`.
SERVICE_SETTINGS: dict[str, tuple[str, ...]] = {
    "chat": ("chatmesh.mesh.settings", "chatmesh.chat.settings", "chatmesh.model.settings"),
    "store": ("chatmesh.mesh.settings", "chatmesh.store.settings"),
    "router": ("chatmesh.mesh.settings", "chatmesh.router.settings"),
    "engine": ("chatmesh.mesh.settings", "chatmesh.engine_adapter.settings", "chatmesh.engine_adapter.local.settings",
               "chatmesh.engine_adapter.triton.settings", "chatmesh.model.settings"),
    "moderation": ("chatmesh.mesh.settings", "chatmesh.moderation.settings"),
    "gateway": ("chatmesh.mesh.settings", "chatmesh.gateway.settings"),
    # `chatmesh users|keys|groups`: the gateway's accounts, whose tables live in the store's database unless
    # CHATMESH_AUTH_DATABASE_URL names another (`chatmesh.gateway.cli.accounts_for`)
    "accounts": ("chatmesh.mesh.settings", "chatmesh.gateway.settings", "chatmesh.store.settings"),
}


class _HelpAll(argparse.Action):
    """`--help-all`: the help with every setting, not only the command's own."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show every setting's flag (the help lists only this command's)")
        self.hidden: list[tuple[argparse.Action, str]] = []

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        for action, text in self.hidden:
            action.help = text
        parser.print_help()
        parser.exit()


def _title(module: str) -> str:
    name = module.removeprefix("chatmesh.").removesuffix(".settings").replace("engine_adapter", "engine")
    return f"{name.replace('.', ' ')} settings" if name != "mesh" else "mesh-wide settings"


def add_flags(parser: argparse.ArgumentParser, *shown: str) -> None:
    """Every setting as a flag (precedence over its CHATMESH_* variable). The help lists, grouped by module, only
    the settings of the modules in `shown` (the command's own service's: `SERVICE_SETTINGS`); `--help-all` lists
    every one. Nothing named: every setting is listed."""
    help_all = parser.add_argument("--help-all", action=_HelpAll)
    assert isinstance(help_all, _HelpAll)
    for module in [*shown, *(m for m in SETTING_MODULES if m not in shown)]:
        group = parser.add_argument_group(f"{_title(module)} (each also a CHATMESH_* environment variable)")
        for s in settings_of(module):
            text = f"{s.help} [env {s.env}, default {s.default!r}]"
            action = group.add_argument(s.flag, dest=s.dest, default=None, metavar="VALUE", help=text)
            if shown and module not in shown:
                action.help = argparse.SUPPRESS
                help_all.hidden.append((action, text))


def flags_of(ns: argparse.Namespace) -> dict[str, str | None]:
    return {s.dest: getattr(ns, s.dest, None) for s in all_settings()}


def markdown_table() -> str:
    rows = ["| variable | flag | default | meaning |", "|---|---|---|---|"]
    for s in all_settings():
        default = "" if s.default == "" else f"`{s.default}`"
        rows.append(f"| `{s.env}` | `{s.flag}` | {default} | {s.help} |")
    return "\n".join(rows)
