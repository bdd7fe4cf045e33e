"""Daemon settings in layers: flag > environment > TOML file > built-in default.

Operators keep a daemon's settings in ``/etc/kvpool/*.toml``, override one on
a host through the unit's EnvironmentFile (``MEMD_POOL_BYTES=40GiB``) and one
for a run on the command line; ``--print-config`` shows what won, and from
where. Every layer goes through the flag's own parser and choices, so a bad
value in a file fails the same way, in one line, as on the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from shared.command_line import Ignored, ignored

UNSET: Any = type("Unset", (), {"__repr__": lambda self: "UNSET"})()
NOT_SETTINGS = {"help", "config", "print_config", "command"}
# Variables with a daemon's prefix that are not its settings: clients read them.
CLIENT_VARIABLES = {"MEMD_ADDRESS", "INFERD_ADDRESS"}
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}
SECRETS = {"api_key"}       # settings --print-config names but does not print


class ConfigError(ValueError):
    """A setting in a file or the environment is unknown or invalid; the message names it."""


def add_config_flags(parser: argparse.ArgumentParser, env_prefix: str) -> None:
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help=f"TOML settings, keys named as the flags (default: ${env_prefix}_CONFIG, else none); "
                             f"{env_prefix}_* variables and flags override it")
    parser.add_argument("--print-config", action="store_true", help="print the settings in effect as TOML and exit")


class Layers:
    """Wraps a parser so that what the command line leaves out comes from the environment, then the file.

    Built before parsing: it swaps every default for a marker, which tells a
    flag that was given from one that was not.
    """

    def __init__(self, parser: argparse.ArgumentParser, env_prefix: str) -> None:
        self.prefix = env_prefix
        self.parser = parser
        self.actions = {a.dest: a for a in parser._actions
                        if a.dest not in NOT_SETTINGS and not isinstance(a, argparse._SubParsersAction)}
        if any(a.default is UNSET for a in self.actions.values()):
            raise RuntimeError("this parser is already wrapped: build a fresh one")
        self.defaults = {dest: a.default for dest, a in self.actions.items()}
        self.required = {dest for dest, a in self.actions.items() if a.required}
        self.sources: dict[str, str] = {}
        for a in self.actions.values():
            a.default, a.required = UNSET, False

    def resolve(self, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> argparse.Namespace:
        """Fill in `args` (parsed with this parser) from the environment, the file and the defaults."""
        environ = os.environ if environ is None else environ
        path = args.config or (Path(environ[f"{self.prefix}_CONFIG"]) if environ.get(f"{self.prefix}_CONFIG") else None)
        layers = {"flag": {dest: getattr(args, dest) for dest in self.actions if getattr(args, dest) is not UNSET},
                  "env": self._from_env(environ)}
        layers["file"] = self._from_file(path) if path is not None else {}
        self._settle_exclusions(layers)
        for dest in self.actions:
            for layer, label in (("flag", "flag"), ("env", f"${self.env_name(dest)}"), ("file", str(path))):
                if dest in layers[layer]:
                    setattr(args, dest, layers[layer][dest])
                    self.sources[dest] = label
                    break
            else:
                if dest in self.required:
                    raise ConfigError(f"{self.flag(dest)} is required (or ${self.env_name(dest)}, "
                                      f"or {self.key(dest)} in the config file)")
                setattr(args, dest, self.defaults[dest])
                self.sources[dest] = "default"
        return args

    def settle(self, args: argparse.Namespace, program: str, rules: Iterable[Ignored] = ()) -> int | None:
        """What a daemon's main() does with its layers: an exit code when it should stop here, else None.

        `rules`: settings that do nothing in some company; each one given there is warned about.
        """
        try:
            self.resolve(args)
        except ConfigError as exc:
            print(f"{program}: {exc}", file=sys.stderr)
            return 2
        for name in self.unknown_variables():
            print(f"{program}: warning: ${name} is not a setting of {program}; ignored "
                  f"(see {program} --print-config)", file=sys.stderr)
        for warning in ignored(self.given(), rules):
            print(f"{program}: warning: {warning}", file=sys.stderr)
        if args.print_config:
            sys.stdout.write(self.render(args))
            return 0
        return None

    def given(self) -> set[str]:
        """The settings some layer set (after resolve): the rest kept their defaults."""
        return {dest for dest, source in self.sources.items() if source != "default"}

    def unknown_variables(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """Prefixed variables that set nothing: a typo, or a leftover such as MEMD_ARGS from an old unit file."""
        environ = os.environ if environ is None else environ
        known = {self.env_name(dest) for dest in self.actions} | {f"{self.prefix}_CONFIG"} | CLIENT_VARIABLES
        return sorted(name for name in environ if name.startswith(f"{self.prefix}_") and name not in known)

    def render(self, args: argparse.Namespace) -> str:
        """The settings in effect as a TOML file that reproduces them, each with where it came from."""
        lines = [f"# {self.parser.prog} settings in effect (flag > ${self.prefix}_* > config file > default)"]
        width = max(len(self.key(dest)) for dest in self.actions)
        for dest in self.actions:
            value = getattr(args, dest)
            if value is None:
                lines.append(f"# {self.key(dest)} is not set")
                continue
            if dest in SECRETS:       # said to be set, and where, but never printed: the output gets pasted
                lines.append(f"# {self.key(dest)} is set (not shown)  # {self.sources.get(dest, 'default')}")
                continue
            text = json.dumps(str(value) if isinstance(value, Path) else value)
            lines.append(f"{self.key(dest):<{width}} = {text:<24} # {self.sources.get(dest, 'default')}")
        return "\n".join(lines) + "\n"

    def env_name(self, dest: str) -> str:
        return f"{self.prefix}_{dest.upper()}"

    def key(self, dest: str) -> str:
        return dest.replace("_", "-")

    def flag(self, dest: str) -> str:
        return self.actions[dest].option_strings[0] if self.actions[dest].option_strings else dest

    def _from_env(self, environ: Mapping[str, str]) -> dict[str, Any]:
        return {dest: self._convert(dest, environ[self.env_name(dest)], f"${self.env_name(dest)}")
                for dest in self.actions if self.env_name(dest) in environ}

    def _from_file(self, path: Path) -> dict[str, Any]:
        try:
            with path.open("rb") as f:
                table = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path} is not valid TOML: not UTF-8 text") from None
        values = {}
        for key, value in table.items():
            dest = key.replace("-", "_")
            if dest not in self.actions:
                raise ConfigError(f"{path}: unknown setting {key!r} (the settings are the flags of "
                                  f"`{self.parser.prog} --help`, without the dashes in front)")
            values[dest] = self._convert(dest, value, f"{path}: {key}")
        return values

    def _convert(self, dest: str, value: Any, where: str) -> Any:
        """A value from a file or the environment, through the flag's own type and choices."""
        action = self.actions[dest]
        if isinstance(action, argparse._StoreTrueAction):
            if isinstance(value, str) and value.strip().lower() in TRUE | FALSE:
                return value.strip().lower() in TRUE
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: expected true or false, got {value!r}")
            return value
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected a single value, got {value!r}")
        try:
            converted = action.type(str(value)) if callable(action.type) else value  # type: ignore[misc]
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise ConfigError(f"{where}: {exc or f'invalid value {value!r}'}") from None   # exc names the value
        if action.choices is not None and converted not in action.choices:
            raise ConfigError(f"{where}: {converted!r} is not one of {', '.join(map(str, action.choices))}")
        return converted

    def _settle_exclusions(self, layers: dict[str, dict[str, Any]]) -> None:
        """Of flags that exclude each other, the highest layer's wins; two in one file or environment clash."""
        for group in self.parser._mutually_exclusive_groups:
            members = [a.dest for a in group._group_actions if a.dest in self.actions]
            for layer in ("flag", "env", "file"):
                given = [dest for dest in members if dest in layers[layer]]
                if len(given) > 1:
                    raise ConfigError(f"{' and '.join(self.key(d) for d in given)} exclude each other "
                                      f"(both set by {layer})")
                if given:
                    for lower in ("env", "file"):
                        for dest in members:
                            if dest != given[0] and layer != lower:
                                layers[lower].pop(dest, None)
                    break
