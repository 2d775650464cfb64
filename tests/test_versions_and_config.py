"""Versions and config spellings: ``cdcd --version`` names the release (pyproject's) and, from a git
checkout, the commit; a renamed config spelling is read as its new one with a warning for one minor
release (``cdcd --strict-config`` refuses it); an unknown key a typo away from a real one is named
with it ("did you mean")."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd.config import (
    DEPRECATED,
    CacheFilter,
    ConfigError,
    close_key,
    convert,
    edit_distance,
    regex_as_globs,
    set_deprecation_policy,
    upgrade_table,
)
from cdcd.daemon.config import DaemonConfig, env_overrides
from cdcd.kafka.options import KafkaToNodeOptions
from cdcd.node.config import NodeConfig
from cdcd.sinks import load_consumer
from cdcd.version import release, version
from tests.support.config import write_daemon_config
from tests.support.procs import ROOT, cdcd, child_env, log_events, reap, start_daemon, stop_daemon, wait_for
from tests.support.wal import jsonl_lines, read_jsonl, wal_events
from tests.support.writer import make_node

PYPROJECT_VERSION: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
GIT = shutil.which("git")


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return done.stdout.strip()


# --- cdcd --version ------------------------------------------------------------------------------------------------


def test_version_prints_pyprojects_release_and_this_checkouts_commit() -> None:
    """`cdcd --version` in a subprocess: the release is pyproject's, and from this checkout the commit is one of its
    history (HEAD, or an ancestor if someone committed meanwhile), marked -dirty or not."""
    res = cdcd("--version")
    assert res.returncode == 0 and res.stderr == ""
    if GIT is None or not (ROOT / ".git").exists():
        assert res.stdout == f"cdcd {PYPROJECT_VERSION}\n"
        return
    m = re.fullmatch(rf"cdcd {re.escape(PYPROJECT_VERSION)} \(git ([0-9a-f]{{12}})(-dirty)?\)\n", res.stdout)
    assert m, res.stdout
    subprocess.run(["git", "merge-base", "--is-ancestor", m.group(1), "HEAD"], cwd=ROOT, check=True, timeout=30)


def _fake_install(root: Path, *, checkout: bool) -> Path:
    """A tree holding cdcd/version.py (and, as a checkout, pyproject.toml under git) to import it from."""
    (root / "cdcd").mkdir(parents=True)
    (root / "cdcd" / "__init__.py").write_text("")
    shutil.copy(ROOT / "cdcd" / "version.py", root / "cdcd" / "version.py")
    if checkout:
        (root / "pyproject.toml").write_text('[project]\nname = "cdcd"\nversion = "7.8.9"\n')
        _git(root, "init", "-q")
        _git(root, "add", "cdcd", "pyproject.toml")
        _git(root, "commit", "-q", "-m", "first")
    return root


def _version_of(root: Path, path_env: str | None = None) -> str:
    env = {**child_env(), "PYTHONPATH": str(root)}
    if path_env is not None:
        env["PATH"] = path_env
    code = (
        "import cdcd.version as v, pathlib, importlib.metadata as m; "
        f"assert pathlib.Path(v.__file__).is_relative_to({str(root)!r}), v.__file__; "
        "print(v.version_and_commit() if v.commit() else f'{v.version()} metadata={m.version(\"cdcd\")}')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(GIT is None, reason="needs git")
def test_version_marks_a_dirty_tree_and_leaves_the_commit_out_without_git_or_a_checkout(tmp_path: Path) -> None:
    """Clean checkout: its commit; a tracked file changed: -dirty (an untracked one is not); git missing from PATH:
    the version alone; no checkout (as installed from a wheel): the package metadata's version alone."""
    repo = _fake_install(tmp_path / "repo", checkout=True)
    head = _git(repo, "rev-parse", "--short=12", "HEAD")
    assert _version_of(repo) == f"7.8.9 (git {head})"
    (repo / "notes.txt").write_text("untracked\n")
    assert _version_of(repo) == f"7.8.9 (git {head})"
    (repo / "pyproject.toml").write_text('[project]\nname = "cdcd"\nversion = "7.8.10"\n')
    assert _version_of(repo) == f"7.8.10 (git {head}-dirty)"
    assert _version_of(repo, path_env=str(tmp_path / "no-bin")).startswith("7.8.10 metadata=")  # no git: no commit

    wheel = _fake_install(tmp_path / "site", checkout=False)
    released, metadata = _version_of(wheel).split(" metadata=")
    assert released == metadata and re.fullmatch(r"\d+\.\d+\.\d+.*", released)


# --- deprecated spellings --------------------------------------------------------------------------------------------


@pytest.fixture
def told() -> Iterator[list[str]]:
    """The deprecation warnings given while the test runs (the process's policy back to a library's after)."""
    lines: list[str] = []
    set_deprecation_policy(strict=False, echo=lines.append)
    try:
        yield lines
    finally:
        set_deprecation_policy(strict=False)


OLD_AND_NEW: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    (
        'kind = "spark"',
        {"kind": "spark", "lake_path": "/x"},
        {"kind": "lake", "lake_path": "/x"},
        """key 'kind': "spark" is now "lake\"""",
    ),
    (
        'writer = "arrow"',
        {"kind": "lake", "lake_path": "/x", "writer": "arrow"},
        {"kind": "lake", "lake_path": "/x", "writer": "deltalake"},
        """key 'writer': "arrow" is now "deltalake\"""",
    ),
    (
        "max_retry_s",
        {"kind": "null", "max_retry_s": 7},
        {"kind": "null", "retry_timeout_s": 7},
        "key 'max_retry_s' is now 'retry_timeout_s'",
    ),
    (
        'caches = "<regex>"',
        {"kind": "null", "caches": "ord.*|events"},
        {"kind": "null", "caches": ["ord*", "events"]},
        """key 'caches': one regular expression ('ord.*|events') is now a list of names or globs: """
        """caches = ["ord*", "events"]""",
    ),
]


def _behaviour(table: dict[str, Any]) -> tuple[Any, ...]:
    consumer, policy = load_consumer(table, "c.toml: consumer")
    selected = CacheFilter.parse(upgrade_table(table, "consumer", "c.toml: consumer"))
    names = ["orders", "ord", "order_lines", "events", "users", "events2"]
    return (
        type(consumer),
        getattr(consumer, "options", None),
        policy.retry_timeout_s,
        [n for n in names if selected(n)],
    )


@pytest.mark.parametrize(("old", "table", "new_table", "said"), OLD_AND_NEW, ids=[o[0] for o in OLD_AND_NEW])
def test_each_deprecated_spelling_is_read_as_the_new_one_with_one_warning(
    told: list[str], old: str, table: dict[str, Any], new_table: dict[str, Any], said: str
) -> None:
    """A consumer table with the old spelling builds the consumer the new spelling builds (same class, options,
    retry timeout, selected caches), and the warning names the key, the new spelling and the release that refuses
    it; read again, it is not told again."""
    assert _behaviour(table) == _behaviour(new_table)
    assert told == [f"c.toml: consumer: {said} (deprecated in 0.2.0, refused from 0.3.0)"]
    _behaviour(table)
    assert len(told) == 1
    assert _behaviour(new_table) and len(told) == 1


def test_deprecated_spellings_are_read_in_every_file_that_has_them(told: list[str]) -> None:
    """The daemon's [consumer], the node's [realtime_consumer] and kafka-to-node's file, through the loaders every
    command uses; both spellings of one key set together are refused."""
    daemon = convert({"node_dir": "n", "consumer": {"kind": "spark", "lake_path": "/x"}}, DaemonConfig, "d.toml")
    assert daemon.consumer == {"kind": "lake", "lake_path": "/x"}
    node = convert({"node_dir": "n", "realtime_consumer": {"kind": "null", "caches": "a|b_.*"}}, NodeConfig, "n.toml")
    assert node.realtime_consumer == {"kind": "null", "caches": ["a", "b_*"]}
    k2n = {"bootstrap_servers": "127.0.0.1:1", "topic": "t", "target": "127.0.0.1:2", "token_file": "/t"}
    opts = KafkaToNodeOptions.load({**k2n, "max_retry_s": 9, "caches": "^orders$"}, "k.toml")
    assert (opts.retry_timeout_s, opts.caches) == (9.0, ["orders"])
    assert [line.split(": key")[0] for line in told] == [
        "d.toml: consumer",
        "n.toml: realtime_consumer",
        "k.toml",
        "k.toml",
    ]
    with pytest.raises(ConfigError, match=r"^c: key 'max_retry_s' is the old spelling of 'retry_timeout_s', which"):
        load_consumer({"kind": "null", "max_retry_s": 1, "retry_timeout_s": 2}, "c")


def test_strict_policy_refuses_instead_of_warning() -> None:
    lines: list[str] = []
    set_deprecation_policy(strict=True, echo=lines.append)
    try:
        with pytest.raises(ConfigError) as info:
            load_consumer({"kind": "null", "max_retry_s": 7}, "c.toml: consumer")
    finally:
        set_deprecation_policy(strict=False)
    assert str(info.value) == (
        "c.toml: consumer: key 'max_retry_s' is now 'retry_timeout_s' (the old spelling is deprecated in 0.2.0, "
        "refused from 0.3.0; --strict-config refuses it)"
    )
    assert lines == []


# The old form: one Python regular expression, matched with re.fullmatch. Names without a line break.
_NAMES = st.text(alphabet="ab_-.x", max_size=6)
_TOKENS = st.sampled_from(["a", "b", "_", "-", "x", "\\.", ".", ".*", ".+"])
_ALTERNATIVE = st.lists(_TOKENS, min_size=1, max_size=4).map("".join)


def _regex(alternatives: list[str], caret: bool, dollar: bool, group: bool) -> str:
    body = "|".join(("^" if caret else "") + a + ("$" if dollar else "") for a in alternatives)
    return f"({body})" if group else body


_REGEX = st.builds(
    _regex,
    st.lists(_ALTERNATIVE, min_size=1, max_size=3),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(regex=_REGEX, names=st.lists(_NAMES, max_size=20))
def test_a_one_regex_caches_read_as_globs_selects_the_same_caches(regex: str, names: list[str]) -> None:
    """Every regex regex_as_globs reads becomes globs that select exactly the names the regex fullmatched."""
    globs = regex_as_globs(regex)
    assert globs is not None, regex
    selected = CacheFilter(globs)
    for name in [*names, "a", "ab", "a.b", "axb", ""]:
        assert selected(name) == (re.fullmatch(regex, name) is not None), (regex, globs, name)


@pytest.mark.parametrize("regex", ["[ab]c", "a+", r"\d+", "a|", "(a|b)c", "a{2}", "a?", "orders|(people)", "a b"])
def test_a_regex_no_glob_list_says_exactly_stays_refused(told: list[str], regex: str) -> None:
    """Only what globs say exactly is read; anything else is refused as in 0.1.0, naming a list to write."""
    assert regex_as_globs(regex) is None
    with pytest.raises(ConfigError, match=r"key 'caches': one regular expression .* is the old form, no longer read"):
        load_consumer({"kind": "null", "caches": regex}, "c.toml: consumer")
    assert told == []


def test_every_deprecation_is_removed_one_minor_release_later_and_documented() -> None:
    """An entry whose removal release has come fails here (delete it then); each is read from its release for one
    minor release; docs/operations.md names each old and new spelling."""
    docs = (ROOT / "docs" / "operations.md").read_text()
    now = release(version())
    assert now == release(PYPROJECT_VERSION)
    for d in DEPRECATED:
        since, until = release(d.deprecated_in), release(d.removed_in)
        assert since <= now < until, f"{d.old}: refused from {d.removed_in}: delete its DEPRECATED entry"
        assert until == (since[0], since[1] + 1, 0), d
        assert f"`{d.old}`" in docs and f"`{d.new}`" in docs, f"docs/operations.md does not name {d.old} -> {d.new}"


# --- the command line ------------------------------------------------------------------------------------------------


def test_cdcd_run_reads_old_spellings_warns_and_delivers_as_the_new_ones(tmp_path: Path) -> None:
    """A daemon config with `max_retry_s` and a one-regex `caches` runs: one `cdcd: warning:` line and one
    `config_deprecated` log line for each, `daemon_started` names the version, and the jsonl file holds exactly
    the WAL entries of the caches the regex matched."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=2, tx_per_segment=3)
    out = tmp_path / "out.jsonl"
    consumer = {"kind": "jsonl", "path": str(out), "max_retry_s": 30, "caches": "ord.*|events"}
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, consumer)
    expected = [e for e in wal_events(node_dir) if e["cache"] in ("orders", "events")]
    assert expected and len(expected) < len(wal_events(node_dir))
    err = tmp_path / "err"
    proc = start_daemon(config, err)
    try:
        wait_for(lambda: jsonl_lines(out) >= len(expected) or proc.poll() is not None, 60, "delivery")
        assert stop_daemon(proc) == 0, err.read_text()[-3000:]
    finally:
        reap(proc)
    assert read_jsonl(out) == expected
    text = err.read_text()
    warnings = [line for line in text.splitlines() if line.startswith("cdcd: warning:")]
    assert warnings == [
        f"cdcd: warning: {config}: consumer: key 'max_retry_s' is now 'retry_timeout_s' "
        "(deprecated in 0.2.0, refused from 0.3.0)",
        f"cdcd: warning: {config}: consumer: key 'caches': one regular expression ('ord.*|events') is now a list of "
        'names or globs: caches = ["ord*", "events"] (deprecated in 0.2.0, refused from 0.3.0)',
    ]
    events = log_events(err)
    told = [(e["old"], e["new"], e["removed_in"]) for e in events if e["event"] == "config_deprecated"]
    assert told == [
        ("max_retry_s", "retry_timeout_s", "0.3.0"),
        ('caches = "<regex>"', 'caches = ["<name or glob>", ...]', "0.3.0"),
    ]
    started = next(e for e in events if e["event"] == "daemon_started")
    assert started["version"].split(" ")[0] == PYPROJECT_VERSION


@pytest.mark.parametrize(("old", "table", "new_table", "said"), OLD_AND_NEW, ids=[o[0] for o in OLD_AND_NEW])
def test_strict_config_refuses_each_old_spelling_in_one_line(
    tmp_path: Path, old: str, table: dict[str, Any], new_table: dict[str, Any], said: str
) -> None:
    """`cdcd --strict-config run` exits 2 with one line naming the key and its new spelling, before it does anything."""
    config = write_daemon_config(tmp_path / "cdcd.toml", tmp_path / "node", table)
    res = cdcd("--strict-config", "run", "--config", str(config))
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"cdcd: error: {config}: consumer: {said} (the old spelling is deprecated in 0.2.0, refused from 0.3.0; "
        "--strict-config refuses it)"
    ]
    assert not (tmp_path / "node").exists()


def test_strict_config_from_the_environment_and_for_node_and_state_commands(tmp_path: Path) -> None:
    """CDCD_STRICT_CONFIG=1 is --strict-config; `node run` refuses an old spelling in [realtime_consumer] and reads
    it with a warning without (its `node_opened` line names the version); `state show` warns on stderr and keeps
    stdout for its output."""
    node_cfg = tmp_path / "node.toml"
    node_cfg.write_text(
        f'node_dir = "{tmp_path / "node"}"\n[realtime_consumer]\nkind = "spark"\nlake_path = "{tmp_path / "lake"}"\n'
    )
    line = f"""{node_cfg}: realtime_consumer: key 'kind': "spark" is now "lake\""""
    res = cdcd("node", "run", "--config", str(node_cfg), env={**child_env(), "CDCD_STRICT_CONFIG": "1"})
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"cdcd: error: {line} (the old spelling is deprecated in 0.2.0, refused from 0.3.0; --strict-config refuses it)"
    ]
    res = cdcd("node", "run", "--config", str(node_cfg), "--seconds", "0.1", "--log-format", "json")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[0] == f"cdcd: warning: {line} (deprecated in 0.2.0, refused from 0.3.0)"
    logged = [json.loads(x) for x in res.stderr.splitlines()[1:]]
    assert [e["event"] for e in logged].count("config_deprecated") == 1
    opened = next(e for e in logged if e["event"] == "node_opened")
    assert opened["version"].split(" ")[0] == PYPROJECT_VERSION

    daemon_cfg = write_daemon_config(tmp_path / "cdcd.toml", tmp_path / "node", {"kind": "null", "max_retry_s": 5})
    res = cdcd("state", "show", "--config", str(daemon_cfg), "--json")
    assert res.returncode == 0, res.stderr
    assert isinstance(json.loads(res.stdout), dict)
    assert res.stderr.splitlines() == [
        f"cdcd: warning: {daemon_cfg}: consumer: key 'max_retry_s' is now 'retry_timeout_s' "
        "(deprecated in 0.2.0, refused from 0.3.0)"
    ]
    res = cdcd("--strict-config", "state", "show", "--config", str(daemon_cfg), "--json")
    assert res.returncode == 2 and res.stdout == "" and len(res.stderr.splitlines()) == 1


def test_kafka_to_node_refuses_an_old_spelling_under_strict_config(tmp_path: Path) -> None:
    """Its file is read by the same rules: one line naming the key and its new spelling, exit 2, before any broker
    is asked (the one configured does not exist)."""
    config = tmp_path / "k2n.toml"
    config.write_text(
        'bootstrap_servers = "127.0.0.1:9"\ntopic = "t"\ntarget = "127.0.0.1:9"\n'
        f'token_file = "{tmp_path / "token"}"\nmax_retry_s = 5\n'
    )
    res = cdcd("--strict-config", "kafka-to-node", "--config", str(config), "--log-format", "json")
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"cdcd: error: {config}: key 'max_retry_s' is now 'retry_timeout_s' (the old spelling is deprecated in 0.2.0, "
        "refused from 0.3.0; --strict-config refuses it)"
    ]


# --- did you mean -------------------------------------------------------------------------------------------------

K2N = {"bootstrap_servers": "127.0.0.1:1", "topic": "t", "target": "127.0.0.1:2", "token_file": "/t"}
TYPOS: list[tuple[str, Any, str]] = [
    ("daemon", lambda: convert({"node_dir": "n", "batch_max_evnts": 1}, DaemonConfig, "d.toml"), "batch_max_events"),
    (
        "node",
        lambda: convert({"node_dir": "n", "wal_segmnt_size_bytes": 1}, NodeConfig, "n.toml"),
        "wal_segment_size_bytes",
    ),
    ("jsonl", lambda: load_consumer({"kind": "jsonl", "path": "x", "fsynk": True}, "c"), "fsync"),
    ("common key", lambda: load_consumer({"kind": "jsonl", "path": "x", "retry_timout_s": 1}, "c"), "retry_timeout_s"),
    ("cache filter", lambda: load_consumer({"kind": "null", "exclude_cache": ["a"]}, "c"), "exclude_caches"),
    ("lake", lambda: load_consumer({"kind": "lake", "lake_pth": "/x"}, "c"), "lake_path"),
    (
        "lake storage",
        lambda: load_consumer({"kind": "lake", "lake_path": "/x", "storage": {"endpont": "e"}}, "c"),
        "endpoint",
    ),
    ("kafka", lambda: load_consumer({"kind": "kafka", "bootstrap_servers": "h:1", "topc": "t"}, "c"), "topic"),
    (
        "replication",
        lambda: load_consumer({"kind": "replication", "target": "h:1", "tokn_file": "/t"}, "c"),
        "token_file",
    ),
    ("python", lambda: load_consumer({"kind": "python", "clas": "m:C"}, "c"), "class"),
    ("kafka-to-node", lambda: KafkaToNodeOptions.load({**K2N, "grop_id": "g"}, "k.toml"), "group_id"),
    ("kafka-to-node target", lambda: KafkaToNodeOptions.load({**K2N, "tls_certt": "c"}, "k.toml"), "tls_cert"),
]


@pytest.mark.parametrize(("what", "load", "meant"), TYPOS, ids=[t[0] for t in TYPOS])
def test_an_unknown_key_near_a_real_one_is_named_with_it(what: str, load: Any, meant: str) -> None:
    """Every config file and consumer table: `unknown key 'x' (did you mean 'y'?)`, y a key of that same table."""
    with pytest.raises(ConfigError) as info:
        load()
    assert re.fullmatch(rf".*: unknown key '[\w.]+' \(did you mean '{meant}'\?\)", str(info.value)), str(info.value)


def test_a_key_near_nothing_gets_no_hint_and_the_environment_gets_the_same_rule() -> None:
    with pytest.raises(ConfigError, match=r"^c: unknown key 'zzzz'$"):
        load_consumer({"kind": "null", "zzzz": 1}, "c")
    with pytest.raises(ConfigError, match=r"^d.toml: unknown key 'xy'$"):  # two edits make a short key anything
        convert({"node_dir": "n", "xy": 1}, DaemonConfig, "d.toml")
    with pytest.raises(ConfigError, match="did you mean CDCD_BATCH_MAX_EVENTS"):
        env_overrides({"CDCD_BATCH_MAX_EVNTS": "5"})
    ignored: list[str] = []
    assert env_overrides({"CDCD_DEPLOY_ID": "5"}, ignored=ignored) == {} and ignored == ["CDCD_DEPLOY_ID"]


def test_edit_distance_counts_a_swap_as_one_edit() -> None:
    assert edit_distance("batch_max_evnts", "batch_max_events") == 1
    assert edit_distance("bacth", "batch") == 1
    assert edit_distance("", "ab") == 2 and edit_distance("kitten", "sitting") == 3
    assert close_key("topc", ["topic", "topic_prefix"]) == "topic"
    assert close_key("writr", ["writer", "write"]) == "write"  # the closest wins
    assert close_key("lake_path", ["lake_path"]) is None  # a known key is not its own typo
