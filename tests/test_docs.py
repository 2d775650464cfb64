"""The docs are checked, not trusted (issue 30, item 7): every ``cdcd …`` command line in README.md and
docs/*.md parses (it runs with ``--help``: its subcommands and options exist), and every config key the docs
name (the key tables, the TOML examples, their commented-out keys too) is a field of the config struct that
reads it."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import click
import msgspec
import pytest
from click.testing import CliRunner

from cdcd.cli import main
from cdcd.daemon.config import DaemonConfig
from cdcd.kafka.options import KafkaSinkOptions, KafkaToNodeOptions
from cdcd.lake.sink import LakeOptions
from cdcd.lake.storage import StorageOptions
from cdcd.lake.typed.declared import TableOptions
from cdcd.node.config import NodeConfig
from cdcd.replication.target import TargetOptions
from cdcd.sinks import COMMON_KEYS
from cdcd.sinks.jsonl import JsonlOptions
from cdcd.sinks.null import NullOptions
from cdcd.sinks.python import PythonOptions
from cdcd.sinks.replication import ReplicationOptions

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_SPAN = re.compile(r"`(cdcd [^`]+)`")
_SHELL_LINE = re.compile(r"^\s*(?:\$\s+|sudo\s+(?:-u\s+\S+\s+)?)?(cdcd\s.*)$")


def _where(path: Path, text: str, offset: int) -> str:
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, offset) + 1}"


def doc_commands() -> list[tuple[str, str]]:
    """(file:line, command line) of every ``cdcd …`` in a code span or on a line of a code block."""
    out: list[tuple[str, str]] = []
    for path in DOCS:
        text = path.read_text()
        blocks = [
            (m.start(2), m.group(2)) for m in _FENCE.finditer(text) if m.group(1) in ("", "sh", "bash", "console")
        ]
        for start, body in blocks:
            for i, line in enumerate(body.splitlines()):
                m = _SHELL_LINE.match(line)
                if m:
                    out.append((_where(path, text, start) + f"+{i}", m.group(1)))
        prose = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for m in _SPAN.finditer(prose):
            out.append((_where(path, text, m.start()), m.group(1)))
    return out


def argv(line: str) -> list[str]:
    """The arguments of a documented command line, placeholders and all: ``[--json]`` is ``--json``,
    ``on|off`` is ``on``, ``…`` is dropped; a pipe or redirection ends it."""
    line = line.replace("\\|", "|")
    line = re.split(r"\s[|>]\s|\s2>|\s&&\s|\s#\s", line)[0]
    try:
        words = shlex.split(line)
    except ValueError:
        words = line.split()
    out: list[str] = []
    for word in words[1:]:
        word = word.strip("[]{}()")
        if word in ("…", "...") and out and out[-1].startswith("-"):
            word = "X"  # an elided option value
        if not word or word in ("…", "...") or word.startswith("…"):
            continue
        out.append(word.split("|")[0])
    return out


COMMANDS = doc_commands()


def test_the_docs_name_many_commands() -> None:
    """The extraction sees the commands the docs are full of (a broken pattern would let every check pass)."""
    lines = {line.split()[1] for _, line in COMMANDS}
    assert len(COMMANDS) > 80 and {"run", "node", "wal", "control", "lake", "state", "kafka-to-node"} <= lines


def check_command(args: list[str]) -> tuple[list[str], str]:
    """(the subcommand path of ``args``, what is wrong with them: "" when every subcommand and option
    exists). An option's value is skipped; a word where a group expects a subcommand must be one."""
    cmd: click.Command = main
    path: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        if word.startswith("-"):
            name = word.split("=")[0]
            opt = next(
                (p for p in cmd.params if isinstance(p, click.Option) and name in p.opts + p.secondary_opts), None
            )
            if opt is None:
                return path, f"`cdcd {' '.join(path)}` has no option {name}"
            i += 1 if opt.is_flag or "=" in word or opt.count else 2
        elif isinstance(cmd, click.Group):
            rest = args[i:]
            try:
                with click.Context(cmd) as ctx:
                    sub_name, sub, left = cmd.resolve_command(ctx, rest)
            except click.UsageError as exc:
                return path, f"`cdcd {' '.join(path)}`: {exc.message}"
            assert sub is not None and sub_name is not None
            path.append(sub_name)
            cmd = sub
            i += len(rest) - len(left)
        else:
            i += 1  # an argument
    return path, ""


@pytest.mark.parametrize(("where", "line"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_documented_command_parses(where: str, line: str) -> None:
    """Each documented command line names subcommands and options that exist, and its command runs with --help."""
    args = argv(line)
    path, problem = check_command(args)
    assert not problem, f"{where}: `{line}`: {problem}"
    res = CliRunner().invoke(main, [*path, "--help"])
    assert res.exit_code == 0 and "Usage: " in res.output, f"{where}: `{line}`: {res.output}"


def test_a_stale_command_or_option_fails_the_check() -> None:
    """The check above can fail: an unknown subcommand, or an option the command lacks, is found."""
    assert check_command(argv("cdcd lake migrate --lake P"))[1] == "`cdcd lake`: No such command 'migrate'."
    assert check_command(argv("cdcd wal dump PATH --since 3:40"))[1] == "`cdcd wal dump` has no option --since"
    assert check_command(argv("cdcd control cdc realtime on --node-dir D")) == (["control", "realtime"], "")
    assert check_command(argv("cdcd run --log-format json --config F")) == (["run"], "")
    assert argv("cdcd control --node-dir DIR realtime on\\|off") == ["control", "--node-dir", "DIR", "realtime", "on"]
    assert argv("cdcd wal dump var/x --from 3:40 | head -1") == ["wal", "dump", "var/x", "--from", "3:40"]


# --- config keys ------------------------------------------------------------------------------------------
SINKS: dict[str, type[msgspec.Struct]] = {
    "jsonl": JsonlOptions,
    "lake": LakeOptions,
    "kafka": KafkaSinkOptions,
    "replication": ReplicationOptions,
    "python": PythonOptions,
    "null": NullOptions,
}
FREE_TABLES = {"spark_conf", "options", "client_config"}
"""Tables whose keys are passed on as they are (Spark settings, a user class's options, librdkafka)."""
KEY_TABLES = {"daemon.md": DaemonConfig, "node.md": NodeConfig, "kafka.md": KafkaSinkOptions}
KEY_TABLES["replication.md"] = ReplicationOptions


def fields(cls: type[msgspec.Struct]) -> set[str]:
    names = {f.encode_name for f in msgspec.structs.fields(cls)}
    if cls is KafkaToNodeOptions:  # its target's keys are written at the top level (TargetOptions.split)
        names = (names - {"replication"}) | fields(TargetOptions)
    if cls in SINKS.values():
        names |= set(COMMON_KEYS)  # every kind's keys, read by load_consumer (the cache filter's among them)
    return names


def test_key_tables_name_config_fields() -> None:
    """Every key in a docs table headed ``| key |`` or ``| option |`` is a field of the struct that reads it."""
    stale = []
    seen = 0
    for name, cls in KEY_TABLES.items():
        text = (ROOT / "docs" / name).read_text()
        in_table = False
        for number, line in enumerate(text.splitlines(), 1):
            if re.match(r"^\| (key|option) \|", line):
                in_table = True
                continue
            if not line.startswith("|"):
                in_table = False
            if in_table and not line.startswith("|---"):
                first = line.split("|")[1]
                for key in re.findall(r"`([a-z_][a-z0-9_.]*)`", first):
                    seen += 1
                    if key.split(".")[0] not in fields(cls):
                        stale.append(f"docs/{name}:{number}: `{key}` is no key of {cls.__name__}")
    assert seen > 60
    assert not stale, "\n".join(stale)


_TOML_KEY = re.compile(r"(?:^|,)\s*#?\s*([a-z_][a-z0-9_]*)\s*=")
_HEADER = re.compile(r"^\s*#?\s*\[([a-z_.]+)\]")


def toml_blocks() -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        text = path.read_text()
        out += [(_where(path, text, m.start(2)), m.group(2)) for m in _FENCE.finditer(text) if m.group(1) == "toml"]
    return out


def _top_struct(body: str) -> type[msgspec.Struct]:
    if "kafka-to-node" in body:
        return KafkaToNodeOptions
    if "node.toml" in body:
        return NodeConfig
    return DaemonConfig


def _keys(line: str) -> list[str]:
    """Keys set on a line, or named by a commented-out setting (``# linger_ms = 5, batch_size_bytes = …``)."""
    code, _, comment = line.partition("#") if not line.lstrip().startswith("#") else ("", "", line.lstrip()[1:])
    keys = []
    m = re.match(r"^\s*([a-z_][a-z0-9_]*)\s*=", code)
    if m:
        keys.append(m.group(1))
    if comment and re.match(r"^\s*[a-z_][a-z0-9_]*\s*=", comment):
        keys += [k for k in _TOML_KEY.findall(comment.split("#")[0])]
    return keys


@pytest.mark.parametrize(("where", "body"), toml_blocks(), ids=[w for w, _ in toml_blocks()])
def test_toml_examples_parse_and_name_config_fields(where: str, body: str) -> None:
    """Each TOML example parses, and every key it sets or shows commented out is a field of the struct that reads
    that table (the daemon's or node's config, the kafka-to-node config, a sink's options by its kind)."""
    tomllib.loads(body)
    table = ""
    kinds = dict(re.findall(r"^\s*\[([a-z_.]+)\][^\n]*\n(?:[^\[]*?\n)?\s*kind\s*=\s*\"(\w+)\"", body, re.M))
    stale = []
    for number, line in enumerate(body.splitlines()):
        header = _HEADER.match(line)
        if header:
            table = header.group(1)
            continue
        parts = table.split(".") if table else []
        if parts and parts[-1] in FREE_TABLES:
            continue
        if not parts:
            cls = _top_struct(body)
        elif parts[-1] == "storage":
            cls = StorageOptions
        elif len(parts) >= 2 and parts[-2] == "tables":
            cls = TableOptions
        else:
            cls = SINKS[kinds.get(table, "null")]
        for key in _keys(line):
            if key not in fields(cls) and not (parts and key == "kind"):
                stale.append(f"{where}+{number}: `{key}` ([{table}]) is no key of {cls.__name__}")
    assert not stale, "\n".join(stale)


def test_every_toml_example_is_checked() -> None:
    """The examples the docs show (lake, cluster, Kafka, kafka-to-node, realtime) are all found, with their keys."""
    blocks = toml_blocks()
    assert len(blocks) >= 5
    named = [k for _, body in blocks for line in body.splitlines() for k in _keys(line)]
    assert {"lake_path", "bootstrap_servers", "linger_ms", "batch_size_bytes", "tls_server_name"} <= set(named)
    assert isinstance(main, click.Group)


@pytest.mark.parametrize("name", ["cdcd.toml", "node.toml"])
def test_shipped_configs_load_and_their_commented_keys_exist(name: str) -> None:
    """config/cdcd.toml and config/node.toml load with the real loaders (the consumer built, not started), and
    every key they show commented out is a key of the table it sits in."""
    from cdcd.config import load_toml
    from cdcd.daemon.config import load_daemon_config
    from cdcd.sinks import load_consumer

    path = ROOT / "config" / name
    body = path.read_text()
    if name == "cdcd.toml":
        config = load_daemon_config(path, environ={})
        load_consumer(config.consumer, f"{path}: consumer")
    else:
        load_toml(path, NodeConfig)
    top = DaemonConfig if name == "cdcd.toml" else NodeConfig
    table, kind, stale = "", "null", []
    for number, line in enumerate(body.splitlines(), 1):
        header = _HEADER.match(line)
        if header:
            table, kind = header.group(1), "null"
            continue
        found = re.match(r'^\s*#?\s*kind\s*=\s*"(\w+)"', line)
        if found:
            kind = found.group(1)
            continue
        parts = table.split(".") if table else []
        if parts and parts[-1] in FREE_TABLES:
            continue
        cls = top if not parts else StorageOptions if parts[-1] == "storage" else SINKS[kind]
        stale += [
            f"config/{name}:{number}: `{k}` is no key of {cls.__name__}" for k in _keys(line) if k not in fields(cls)
        ]
    assert not stale, "\n".join(stale)


def test_the_exit_code_table_lists_every_code() -> None:
    """docs/operations.md's exit-code table has one row per `cdcd.faults.ExitCode`, in order, and says which codes
    the units do not restart as the units do (`RestartPreventExitStatus` of the daemon's unit)."""
    from cdcd.faults import ExitCode

    text = (ROOT / "docs" / "operations.md").read_text()
    table = text[text.index("### Exit codes") :]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert [int(r[0]) for r in rows] == [int(c) for c in ExitCode]
    not_restarted = {int(r[0]) for r in rows if r[-1].strip() == "no"}
    unit = (ROOT / "systemd" / "cdcd@.service").read_text()
    prevent = next(line for line in unit.splitlines() if line.startswith("RestartPreventExitStatus="))
    assert not_restarted == {int(c) for c in prevent.split("=")[1].split()}
