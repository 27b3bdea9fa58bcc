"""Generate the documentation's tables from the code, so that they cannot drift from it.

MkDocs runs this file as a hook (`hooks:` in mkdocs.yml): before every build, `on_pre_build` writes Markdown
fragments into `docs_generated/` (gitignored), and the pages include them with pymdownx.snippets
(`--8<-- "docs_generated/NAME.md"`). `python scripts/docs_generate.py` writes the same files by hand.

The fragments:

- `settings.md`: every setting of `hvdplus.common.settings.SETTINGS`, with its environment variable, Horovod
  alias, the hvdplusrun flag and `--config-file` key that set it (found by parsing a command line with each
  flag), default and meaning.
- `horovodrun_flags.md`: every horovodrun flag (Horovod 0.28.1) and what hvdplusrun's parser does with it,
  then hvdplusrun's own flags; the descriptions are the parser's help texts.
- `hvdplusrun_help.md`: `hvdplusrun --help`, as the parser prints it.
- `api_torch.md`, `api_tensorflow.md`: the Horovod names of the API contract (tests/unit/horovod_contract.py,
  which the contract tests check too) and whether hvdplus exports each, with the same parameters.
- `reference/torch.md`, ...: mkdocstrings blocks listing the names each package's `__init__` exports.

hvdplus's packages are read statically with griffe (what mkdocstrings uses), so neither torch nor TensorFlow is
imported; the runner's parser and the settings table are imported (standard library only).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import io
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # document this checkout's hvdplus, not another one installed elsewhere

from tests.unit.horovod_contract import contract  # noqa: E402 (the one reading of the contract lists)

GENERATED_DIR = "docs_generated"

# hvdplus.tensorflow.keras replaces itself in sys.modules by hvdplus.keras (its submodules included), which a
# static reader cannot see; test_tf_api_contract.py checks `hvdplus.tensorflow.keras is hvdplus.keras`.
MODULE_ALIASES = {"hvdplus.tensorflow.keras": "hvdplus.keras"}

# The packages whose exports the API reference documents: page name -> package.
REFERENCE_PACKAGES = {
    "torch": "hvdplus.torch",
    "tensorflow": "hvdplus.tensorflow",
    "keras": "hvdplus.keras",
    "runner": "hvdplus.runner",
}

# horovodrun's flags in Horovod 0.28.1 (horovod/runner/launch.py, parse_args), in its order: the option strings of
# each argparse action and what the action does there. Horovod is no longer developed, so this list is fixed.
HOROVODRUN_FLAGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("-v", "--version"), "print Horovod's version"),
    (("-np", "--num-proc"), "total number of training processes"),
    (("-cb", "--check-build"), "show the frameworks and libraries Horovod was built with"),
    (("--disable-cache",), "run the initialization checks every time instead of once an hour"),
    (("--start-timeout",), "seconds to run the checks and start the processes"),
    (("--network-interfaces",), "comma-separated network interfaces to use"),
    (("--network-interface",), "one network interface (deprecated spelling)"),
    (("--output-filename",), "write each rank's output to DIR/rank.N/stdout|stderr"),
    (("--verbose",), "print extra messages"),
    (("--config-file",), "YAML file with the tunable parameters"),
    (("-p", "--ssh-port"), "ssh port of the hosts"),
    (("-i", "--ssh-identity-file"), "ssh private key"),
    (("--fusion-threshold-mb",), "fusion buffer size in MB"),
    (("--cycle-time-ms",), "milliseconds between fusion cycles"),
    (("--cache-capacity",), "response cache entries"),
    (("--hierarchical-allreduce",), "hierarchical allreduce"),
    (("--no-hierarchical-allreduce",), "no hierarchical allreduce, also under autotune"),
    (("--hierarchical-allgather",), "hierarchical allgather"),
    (("--no-hierarchical-allgather",), "no hierarchical allgather, also under autotune"),
    (("--torus-allreduce",), "2D NCCL torus allreduce"),
    (("--no-torus-allreduce",), "no torus allreduce, also under autotune"),
    (("--autotune",), "autotune the tunable parameters"),
    (("--no-autotune",), "no autotune (hidden in horovodrun's help)"),
    (("--autotune-log-file",), "CSV log of the autotune samples"),
    (("--autotune-warmup-samples",), "autotune samples discarded at the start"),
    (("--autotune-steps-per-sample",), "steps per autotune sample"),
    (("--autotune-bayes-opt-max-samples",), "most samples of the Bayesian optimization"),
    (("--autotune-gaussian-process-noise",), "noise regularization of the Gaussian process"),
    (("--min-np", "--min-num-proc"), "fewest processes to train with (elastic)"),
    (("--max-np", "--max-num-proc"), "most processes (elastic)"),
    (("--slots-per-host",), "slots of a discovered host (elastic)"),
    (("--elastic-timeout",), "seconds to wait for processes after a change (elastic)"),
    (("--reset-limit",), "most resets before the job ends (elastic)"),
    (("--blacklist-cooldown-range",), "seconds MIN MAX a failed host stays blacklisted (elastic)"),
    (("--timeline-filename",), "write a timeline"),
    (("--timeline-mark-cycles",), "mark cycles in the timeline"),
    (("--no-timeline-mark-cycles",), "do not mark cycles (hidden in horovodrun's help)"),
    (("--no-stall-check",), "disable the stall check"),
    (("--stall-check",), "enable the stall check (hidden in horovodrun's help)"),
    (("--stall-check-warning-time-seconds",), "seconds before a stall warning"),
    (("--stall-check-shutdown-time-seconds",), "seconds before a stall shuts the job down"),
    (("--mpi-threads-disable",), "disable MPI threading support"),
    (("--no-mpi-threads-disable",), "keep MPI threading support (hidden in horovodrun's help)"),
    (("--mpi-args",), "extra arguments for mpirun"),
    (("--tcp",), "use TCP only (MPI)"),
    (("--binding-args",), "process binding arguments for mpirun"),
    (("--num-nccl-streams",), "number of NCCL streams"),
    (("--thread-affinity",), "CPU affinity of the background thread"),
    (("--gloo-timeout-seconds",), "seconds for Gloo operations to complete"),
    (("--log-level",), "log level of the backend"),
    (("--log-with-timestamp",), "timestamps in log messages (hidden in horovodrun's help)"),
    (("--log-without-timestamp",), "no timestamps in log messages"),
    (("-prefix-timestamp", "--prefix-output-with-timestamp"), "timestamp every output line"),
    (("--log-hide-timestamp",), "deprecated spelling of --log-without-timestamp"),
    (("--no-log-hide-timestamp",), "deprecated spelling of --log-with-timestamp"),
    (("-H", "--hosts"), "hosts and slots: host1:2,host2:4"),
    (("-hostfile", "--hostfile"), "file with 'hostname slots=N' lines"),
    (("--host-discovery-script",), "script printing the available hosts (elastic)"),
    (("--gloo",), "run with the Gloo controller"),
    (("--mpi",), "run with the MPI controller"),
    (("--jsrun",), "launch with jsrun (IBM LSF)"),
)

HOROVOD_OPTIONS = frozenset(option for options, _ in HOROVODRUN_FLAGS for option in options)

# What the parser's help of an accepted flag that does nothing begins with (hvdplus/runner/args.py).
ACCEPTED_ONLY = "accepted for horovodrun compatibility"


# --- Markdown helpers -------------------------------------------------------------------------------------------


def md_text(text: str) -> str:
    """Escape `text` for a Markdown table cell, leaving its `code spans` as they are."""
    parts = text.replace("\n", " ").split("`")
    for index in range(0, len(parts), 2):  # even parts are outside code spans
        escaped = parts[index].replace("\\", "\\\\")
        for char in "|*_<>[]":
            escaped = escaped.replace(char, "\\" + char)
        parts[index] = escaped
    for index in range(1, len(parts), 2):  # a pipe inside a code span would still end the table cell
        parts[index] = parts[index].replace("|", "\\|")
    return "`".join(parts)


def code(text: str) -> str:
    """`text` as a code span that is safe in a table cell."""
    return "`" + text.replace("|", "\\|") + "`"


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table; cells must already be escaped."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# --- settings ---------------------------------------------------------------------------------------------------


def _sample_argv(action: argparse.Action) -> list[str]:
    """A command line that gives `action` a value its type accepts."""
    if action.nargs == 0:
        return [action.option_strings[0]]
    value = str(next(iter(action.choices))) if action.choices else "1"
    count = action.nargs if isinstance(action.nargs, int) else 1
    return [action.option_strings[0]] + [value] * count


def flags_by_setting() -> dict[str, argparse.Action]:
    """Which hvdplusrun flag sets which HVDPLUS_* variable, found by parsing a command line with each flag."""
    from hvdplus.runner.args import make_parser, parse_args
    from hvdplus.runner.job import tuning_env

    found: dict[str, argparse.Action] = {}
    for action in make_parser()._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                env = tuning_env(parse_args([*_sample_argv(action), "python", "x.py"]))
        except (SystemExit, ValueError):
            continue  # a flag whose sample value the parser refuses (-x, --config-file) sets no setting
        for name in env:
            found.setdefault(name, action)
    return found


def config_keys_by_dest() -> dict[str, str]:
    """The `--config-file` key ("section.key") that fills each parser destination."""
    from hvdplus.runner.config import CONFIG_KEYS

    return {dest: f"{section}.{key}" for (section, key), dest in CONFIG_KEYS.items()}


def format_default(value: Any) -> str:
    """A setting's default as a table cell."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return code("1" if value else "0")
    if value == "":
        return "empty"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return code(str(value))


def settings_rows() -> list[list[str]]:
    """One row per setting of SETTINGS, in its order."""
    from hvdplus.common.settings import SETTINGS

    flags, keys = flags_by_setting(), config_keys_by_dest()
    rows = []
    for setting in SETTINGS:
        action = flags.get(setting.env)
        flag = " / ".join(code(option) for option in action.option_strings) if action else ""
        key = code(keys[action.dest]) if action and action.dest in keys else ""
        rows.append(
            [
                code(setting.env),
                code(setting.alias) if setting.alias else "",
                flag,
                key,
                format_default(setting.default),
                md_text(setting.doc),
            ]
        )
    return rows


def settings_table() -> str:
    """The configuration table: every setting of SETTINGS."""
    headers = ["variable", "Horovod alias", "hvdplusrun flag", "--config-file key", "default", "meaning"]
    return table(headers, settings_rows())


# --- horovodrun flags -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlagRow:
    """One row of the flag table."""

    flags: tuple[str, ...]  # horovodrun's spelling (hvdplusrun's for its own flags)
    does: str
    status: str  # Markdown
    hvdplusrun: tuple[str, ...] = ()  # the option strings of hvdplusrun's matching flag, if it has one


def _help(action: argparse.Action) -> str:
    """A flag's help text, as `--help` prints it."""
    text = action.help or ""
    if "%(" in text:
        text = text % {**vars(action), "prog": "hvdplusrun"}
    return text


def flag_rows() -> list[FlagRow]:
    """Every horovodrun flag with what hvdplusrun does with it, then the flags only hvdplusrun has."""
    from hvdplus.runner.args import make_parser

    parser = make_parser()
    actions = {option: action for action in parser._actions for option in action.option_strings}
    rows, seen = [], set()
    for options, horovod_does in HOROVODRUN_FLAGS:
        present = [option for option in options if option in actions]
        if not present:
            status = "not supported: hvdplusrun stops with `unrecognized arguments`"
            rows.append(FlagRow(options, f"in horovodrun: {horovod_does}", status))
            continue
        action = actions[present[0]]
        seen.add(id(action))
        does = _help(action)
        status = "accepted, has no effect" if does.startswith(ACCEPTED_ONLY) else "supported"
        if isinstance(action, argparse.BooleanOptionalAction) and present[0] != action.option_strings[0]:
            does = f"the opposite of `{action.option_strings[0]}`: {does}"  # --no-X of a --X/--no-X pair
        missing = [option for option in options if option not in actions]
        if missing:
            status += "; not as " + ", ".join(code(option) for option in missing)
        extra = [option for option in action.option_strings if option not in HOROVOD_OPTIONS]
        if extra:
            status += "; also " + ", ".join(code(option) for option in extra)
        rows.append(FlagRow(options, does, status, tuple(action.option_strings)))
    for action in parser._actions:
        if action.option_strings and id(action) not in seen and not isinstance(action, argparse._HelpAction):
            options = tuple(action.option_strings)
            rows.append(FlagRow(options, _help(action), "hvdplusrun only", options))
    return rows


def flags_table() -> str:
    """The horovodrun flag table."""
    rows = ([", ".join(code(f) for f in row.flags), md_text(row.does), row.status] for row in flag_rows())
    return table(["flag", "what it does", "in hvdplusrun"], rows)


def hvdplusrun_help() -> str:
    """`hvdplusrun --help` as a code block, at a fixed width."""
    from hvdplus.runner.args import make_parser

    parser = make_parser()
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100, max_help_position=40)
    vars(parser)["color"] = False  # Python 3.14 colours help on a terminal: no escape codes in the page
    return "```text\n" + parser.format_help() + "```\n"


# --- API coverage -----------------------------------------------------------------------------------------------


class Api:
    """hvdplus's packages as griffe reads them from the source (nothing is imported)."""

    def __init__(self) -> None:
        import griffe

        self._griffe = griffe
        self.package = griffe.load("hvdplus", search_paths=[str(ROOT)], resolve_aliases=False)

    def lookup(self, path: str) -> Any | None:
        """The object at a dotted hvdplus path, or None; module aliases (hvdplus.tensorflow.keras) followed."""
        try:
            return self.package[canonical(path).removeprefix("hvdplus.")]
        except KeyError:
            return None

    def resolve(self, obj: Any) -> Any | None:
        """The object an alias stands for, or None where griffe cannot resolve it."""
        if not obj.is_alias:
            return obj
        try:
            return obj.final_target
        except (self._griffe.AliasResolutionError, self._griffe.CyclicAliasError):
            return None

    def parameters(self, obj: Any) -> list[str] | None:
        """The parameter names of a function, or of a class's constructor (without self)."""
        target = self.resolve(obj)
        if target is None or target.kind.value not in ("function", "class"):
            return None
        names = [p.name for p in target.parameters]
        return names[1:] if target.kind.value == "class" and names[:1] == ["self"] else names


def canonical(path: str) -> str:
    """The path under which a dotted hvdplus name is defined and documented (hvdplus.tensorflow.keras.X is
    hvdplus.keras.X)."""
    for alias, target in MODULE_ALIASES.items():
        if path == alias or path.startswith(alias + "."):
            return target + path[len(alias) :]
    return path


def _status(api: Api, path: str, params: Sequence[str] | None, prefix_only: bool) -> str:
    """Whether hvdplus exports a contract name, and with which parameters (Markdown)."""
    obj = api.lookup(path)
    if obj is None:
        return "missing"
    have = api.parameters(obj) if params is not None else None
    if params is None or have is None:
        return "present"
    if list(params) == have:
        return "present, same parameters"
    if prefix_only and have[: len(params)] == list(params):
        return "present, Horovod's parameters, then " + ", ".join(code(p) for p in have[len(params) :])
    return f"present, parameters differ: {code(', '.join(have))}"


def _link(path: str, documented: set[str]) -> str:
    """An autorefs link to the reference's heading for `path`, or plain code where the reference has none."""
    path = canonical(path)
    return f"[{code(path)}][{path}]" if path in documented else code(path)


@functools.cache
def load_api() -> Api:
    """hvdplus read once per process (about half a second)."""
    return Api()


def api_rows(framework: str) -> list[list[str]]:
    """Rows of the coverage table of `framework` ("torch" or "tensorflow")."""
    api = load_api()
    rows = []
    entries, objects = contract(framework)
    documented = documented_paths(api)
    for entry in entries:
        path = f"{entry.module}.{entry.name}"
        status = _status(api, path, entry.params, prefix_only=framework != "torch")
        signature = f"{entry.name.rsplit('.', 1)[-1]}({', '.join(entry.params)})"
        horovod = code(path.replace("hvdplus", "horovod", 1))
        rows.append([horovod, _link(path, documented), status, code(signature), md_text(entry.note)])
    for module, name in objects:
        path = f"{module}.{name}"
        status = _status(api, path, None, prefix_only=False)
        rows.append([code(path.replace("hvdplus", "horovod", 1)), _link(path, documented), status, "", ""])
    return rows


def api_table(framework: str) -> str:
    """The coverage table of horovod.torch or horovod.tensorflow(.keras)."""
    headers = ["Horovod name", "hvdplus", "status", "Horovod's parameters", "note"]
    return table(headers, api_rows(framework))


# --- API reference ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exports:
    """What a package's __init__ exports: names documented in the package, submodules, and names the static
    reader cannot resolve (listed, not rendered)."""

    members: list[str]
    modules: list[str]
    unresolved: list[str]


def _lazy_exports(tree: ast.Module, package: str) -> dict[str, str]:
    """Names a module-level `__getattr__` serves (`if name == "x":`), mapped to the path they come from."""
    served: dict[str, str] = {}
    for function in tree.body:
        if not (isinstance(function, ast.FunctionDef) and function.name == "__getattr__"):
            continue
        for node in ast.walk(function):
            if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)):
                continue
            constants = [c.value for c in node.test.comparators if isinstance(c, ast.Constant)]
            if not constants or not isinstance(constants[0], str):
                continue
            name, source = constants[0], f"{package}.{constants[0]}"
            for inner in ast.walk(ast.Module(body=node.body, type_ignores=[])):
                if isinstance(inner, ast.ImportFrom) and inner.module and any(a.name == name for a in inner.names):
                    source = f"{inner.module}.{name}"
                elif isinstance(inner, ast.Call) and inner.args and isinstance(inner.args[0], ast.Constant):
                    source = str(inner.args[0].value)  # importlib.import_module("hvdplus.torch.pipeline")
            served[name] = source
    return served


def package_exports(api: Api, package: str) -> Exports:
    """The public names `package`'s __init__ exports: its `__all__` if it has one, else every public name it
    defines or imports from hvdplus, and the names its `__getattr__` serves. A submodule it imports only to call
    into (`device_plane.register()`) is not an export."""
    source = ROOT / package.replace(".", "/") / "__init__.py"
    tree = ast.parse(source.read_text())
    lazy = _lazy_exports(tree, package)
    declared: list[str] | None = None
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            declared = [str(e.value) for e in ast.walk(node.value) if isinstance(e, ast.Constant)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("hvdplus"):
            names += [alias.asname or alias.name for alias in node.names]
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.append(node.name)
    used = {
        node.value.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and isinstance(node.ctx, ast.Load)
    }
    ordered = declared if declared is not None else names + list(lazy)
    members, modules, unresolved = [], [], []
    module_obj = api.lookup(package)
    for name in dict.fromkeys(n for n in ordered if not n.startswith("_")):
        obj = module_obj.members.get(name) if module_obj is not None else None
        if obj is None and name in lazy and lazy[name] != f"{package}.{name}":
            members.append(lazy[name])  # served lazily: documented where it is defined (hvdplus.runner.api.run)
            continue
        if obj is None:
            unresolved.append(name)
            continue
        target = api.resolve(obj)
        if target is None:
            unresolved.append(name)
        elif target.kind.value == "module":
            if declared is not None or name not in used:
                modules.append(target.path)
        else:
            members.append(name)
    return Exports(members, modules, unresolved)


def documented_paths(api: Api) -> set[str]:
    """The dotted paths whose headings the reference pages render (targets of cross-reference links)."""
    paths = set()
    for package in REFERENCE_PACKAGES.values():
        exports = package_exports(api, package)
        for name in exports.members:
            paths.add(name if name.startswith("hvdplus.") else f"{package}.{name}")
        for module in exports.modules:
            module_obj = api.lookup(module)
            public = module_obj.exports if module_obj is not None and module_obj.exports else []
            paths.update(f"{module}.{name}" for name in public)
    return paths


def reference_page(package: str) -> str:
    """mkdocstrings blocks for `package`: its exported names, then each exported submodule."""
    api = load_api()
    exports = package_exports(api, package)
    own = [name for name in exports.members if not name.startswith("hvdplus.")]
    elsewhere = [name for name in exports.members if name.startswith("hvdplus.")]
    lines = [f"::: {package}", "    options:", "      show_root_heading: false", "      members:"]
    lines += [f"        - {name}" for name in own] or ["        []"]
    lines.append("")
    module_obj = api.lookup(package)
    sources: dict[str, list[str]] = {}
    for name in exports.unresolved:
        obj = module_obj.members.get(name) if module_obj is not None else None
        source = obj.target_path.rsplit(".", 1)[0] if obj is not None and obj.is_alias else package
        sources.setdefault(source, []).append(code(name))
    for source, names in sources.items():
        lines += [f"Also exported: {', '.join(names)} (from `{source}`).", ""]
    for path in elsewhere:
        lines += [
            f"::: {path}",
            "    options:",
            "      show_root_heading: true",
            "      show_root_full_path: false",
            "",
        ]
    for module in exports.modules:
        lines += [f"::: {module}", "    options:", "      show_root_heading: true", ""]
    return "\n".join(lines)


# --- output -----------------------------------------------------------------------------------------------------


def fragments() -> dict[str, str]:
    """Every generated fragment: path under the generated folder -> Markdown."""
    notice = "<!-- generated by scripts/docs_generate.py from the code: do not edit -->\n\n"
    files = {
        "settings.md": settings_table(),
        "horovodrun_flags.md": flags_table(),
        "hvdplusrun_help.md": hvdplusrun_help(),
        "api_torch.md": api_table("torch"),
        "api_tensorflow.md": api_table("tensorflow"),
    }
    files.update({f"reference/{page}.md": reference_page(package) for page, package in REFERENCE_PACKAGES.items()})
    return {name: notice + text for name, text in files.items()}


def generate(out_dir: Path) -> list[Path]:
    """Write the fragments under `out_dir`; a file whose content is unchanged is left alone."""
    written = []
    for name, text in fragments().items():
        path = out_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        written.append(path)
    return written


def on_pre_build(config: Any) -> None:
    """MkDocs hook: regenerate the fragments next to mkdocs.yml before every build."""
    generate(Path(config.config_file_path).resolve().parent / GENERATED_DIR)


def main(argv: Sequence[str] | None = None) -> int:
    """Write the fragments by hand: `python scripts/docs_generate.py [--out DIR]`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / GENERATED_DIR, help="folder for the fragments")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
