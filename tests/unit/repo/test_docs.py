"""The documentation against the code it describes, so the two cannot drift apart:

- conf/tpuboot.yaml shows every section and key of tpuboot/config.py, commented out, with its
  default and a line saying what it is;
- the man page has every command and option of the argparse parser in tpuboot/cli.py, every exit
  status the CLI returns, every configuration key and every metric with its labels (doc/monitoring.md
  every metric too), and no page names a metric tpuboot does not declare; doc/operation.md every
  command, option and exit status, the README every command;
- README.md and the doc/ pages link and cite only files inside the repository;
- the man page and the package description say that the package runs privileged containers;
- figures and paths the docs quote come from the code: the bind retries and their waits, every path
  the unit lets tpuboot write, every path the package's purge removes, the README's STATUS line
  (from a daemon of the default configuration), how instruction counts were measured, and the
  date and commit of each table in doc/performance.md.
"""

from __future__ import annotations

import argparse
import itertools
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.unit.helpers.cli import commands
from tpuboot import cli
from tpuboot.config import Config, MatchRule, Section, parse_config
from tpuboot.devices.table import VFIO_KINDS
from tpuboot.metrics_catalog import CATALOG, Metric

TOP = Path(__file__).resolve().parents[3]
CONF = TOP / "conf/tpuboot.yaml"
MAN = TOP / "doc/tpuboot.8"
README = TOP / "README.md"
DOC = TOP / "doc"
OPERATION = DOC / "operation.md"
UNIT = TOP / "systemd/tpuboot.service"
POSTRM = TOP / "debian/tpuboot.postrm"


def pages() -> list[Path]:
    """README.md and every Markdown page under doc/."""
    return [README, *sorted(DOC.glob("*.md"))]


def section(path: Path, heading: str) -> str:
    """The text under ``## heading`` of a Markdown page, up to the next heading of that level."""
    text = path.read_text()
    assert f"\n## {heading}\n" in text, f"{path.name} has no section {heading!r}"
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def unwrapped(text: str) -> str:
    """Prose with its line breaks as blanks, so that a phrase wrapped over two lines is found."""
    return " ".join(text.split())


# --- conf/tpuboot.yaml -----------------------------------------------------------------------------


def uncommented(text: str) -> str:
    """The shipped file with every setting enabled: '#key: value' lines lose their '#'; comments
    ('# text', '#   example') stay comments."""
    return "\n".join(re.sub(r"^(\s*)#(?=[^\s#])", r"\1", line) for line in text.splitlines())


def sections() -> dict[str, type[Section]]:
    """The sections of Config that are mappings of keys (vfio, metadata, ...)."""
    return {
        name: type(option.default)
        for name, option in Config.options.items()
        if isinstance(option.default, Section)
    }


def test_shipped_config_sets_nothing():
    assert parse_config(CONF.read_text(), str(CONF)) == Config()


def test_shipped_config_shows_every_section_and_key():
    shown = yaml.safe_load(uncommented(CONF.read_text()))
    assert sorted(shown) == sorted(Config.options)
    for name, cls in sections().items():
        assert sorted(shown[name] or {}) == sorted(cls.options), f"section {name}"


def test_shipped_config_shows_each_default():
    assert parse_config(uncommented(CONF.read_text()), str(CONF)) == Config()


def test_shipped_config_explains_every_key():
    text = CONF.read_text()
    for name in Config.options:
        assert re.search(rf"^# .+\n#{name}:", text, re.MULTILINE), f"{name} has no line of explanation"
    for section, cls in sections().items():
        for key in cls.options:
            assert re.search(rf"^  # .+\n  #{key}:", text, re.MULTILINE), f"{section}.{key} is not explained"
    devices = text.split("#devices:")[0].rsplit("\n\n", 1)[-1]
    for key in MatchRule.options:  # devices is a list: its item keys are described, not shown
        assert key in devices, f"devices[].{key} is not described"


def test_uncommenting_keeps_comments_and_examples():
    assert (
        uncommented("# text\n#key: 1\n  #sub: x\n#   example: 2\n##x")
        == "# text\nkey: 1\n  sub: x\n#   example: 2\n##x"
    )


# --- doc/tpuboot.8 -------------------------------------------------------------------------------


def plain(roff: str) -> str:
    """Text of man(7) source, enough to find names in: no escapes, fonts, macros or quotes."""
    text = roff.replace("\\-", "-").replace("\\(aq", "'").replace("\\(dq", '"').replace("\\~", " ")
    text = re.sub(r"\\f[BIRP]", "", text)
    text = re.sub(r"^\.[A-Z]{1,2}\b ?", "", text, flags=re.MULTILINE)
    return text.replace('"', "")


def man_sections() -> dict[str, str]:
    parts = re.split(r"^\.SH (.+)$", MAN.read_text(), flags=re.MULTILINE)
    return {title.strip('"'): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def items(section: str) -> list[tuple[str, str]]:
    """(tag, text) of each .TP item of a man page section, in plain text."""
    found = []
    for chunk in re.split(r"^\.TP\n", man_sections()[section], flags=re.MULTILINE)[1:]:
        tag, _, body = chunk.partition("\n")
        found.append((plain(tag).strip(), plain(tag + "\n" + body)))
    return found


def options(parser: argparse.ArgumentParser) -> Iterator[str]:
    """Each option string, positional metavar and choice a user may type, but -h/--help."""
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        yield from action.option_strings or [action.metavar or action.dest]
        yield from action.choices or []


def test_argparse_walk_finds_what_the_cli_has():
    found = dict(commands(cli.build_parser()))
    assert {"run", "bind", "metadata get"} <= found.keys()
    assert {"--default", "--type", "KEY", "instance"} <= set(options(found["metadata get"]))
    assert "-h" not in set(options(found["bind"]))


def test_man_page_lists_every_command_with_its_options():
    documented = items("COMMANDS")
    missing = []
    for path, parser in commands(cli.build_parser()):
        texts = [text for tag, text in documented if re.match(rf"{re.escape(path)}(\s|$)", tag)]
        if not texts:
            missing.append(path)
            continue
        missing += [
            f"{path} {opt}"
            for opt in options(parser)
            if not re.search(rf"(?<![\w-]){re.escape(opt)}\b", texts[0])
        ]
    assert missing == []


def test_man_page_lists_no_command_the_cli_lacks():
    known = {path for path, _ in commands(cli.build_parser())}
    tags = [tag for tag, _ in items("COMMANDS")]
    assert (
        tags
        and [tag for tag in tags if not any(re.match(rf"{re.escape(k)}(\s|$)", tag) for k in known)] == []
    )


def test_man_page_lists_every_global_option():
    tags = " ".join(tag for tag, _ in items("OPTIONS"))
    parser = cli.build_parser()
    wanted = [o for a in parser._actions if not isinstance(a, argparse._HelpAction) for o in a.option_strings]
    assert wanted and [o for o in wanted if not re.search(rf"(?<![\w-]){re.escape(o)}\b", tags)] == []
    synopsis = plain(man_sections()["SYNOPSIS"])
    assert [o for o in ("--root", "--config", "-v") if o not in synopsis] == []


def exit_statuses() -> dict[str, int]:
    return {
        name: value
        for name, value in vars(cli).items()
        if name.startswith("EXIT_") and isinstance(value, int)
    }


def test_man_page_lists_every_exit_status():
    statuses = exit_statuses()
    assert set(statuses.values()) >= {0, 1, 2, 3}, statuses
    documented = {int(tag) for tag, _ in items("EXIT STATUS") if tag.isdigit()}
    assert documented == set(statuses.values())
    epilog = cli.build_parser().epilog or ""
    assert [v for v in statuses.values() if not re.search(rf"\b{v} ", epilog)] == []


def test_man_page_lists_every_configuration_key():
    documented = dict(items("CONFIGURATION"))
    missing = []
    for name, option in Config.options.items():
        cls = (
            type(option.default)
            if isinstance(option.default, Section)
            else MatchRule
            if name == "devices"
            else None
        )
        if name not in documented:
            missing.append(name)
        elif cls is not None:
            missing += [
                f"{name}.{key}" for key in cls.options if not re.search(rf"\b{key}\b", documented[name])
            ]
    assert missing == []


def shown(metric: Metric) -> str:
    """How the man page writes a metric: its name, and its labels in braces."""
    return metric.name + ("{" + ",".join(metric.labels) + "}" if metric.labels else "")


def mentions(text: str, written: str, *, whole: bool) -> bool:
    """``written`` is in ``text`` as a name of its own; ``whole``: with no labels after it either."""
    end = r"(?![\w{])" if whole else r"(?!\w)"
    return re.search(rf"(?<![\w:]){re.escape(written)}{end}", text) is not None


def test_man_page_and_the_monitoring_page_list_every_metric():
    """Every metric declared (tpuboot/metrics_catalog.py): the man page with its labels, as the
    record has them; doc/monitoring.md by name."""
    man = plain(man_sections()["METRICS"])
    monitoring = section(DOC / "monitoring.md", "Metrics")
    assert {
        "man": [shown(m) for m in CATALOG if not mentions(man, shown(m), whole=True)],
        "doc/monitoring.md": [m.name for m in CATALOG if not mentions(monitoring, m.name, whole=False)],
    } == {"man": [], "doc/monitoring.md": []}


#: Names of tpuboot's own that look like a metric's and are not one.
NOT_METRICS = {"tpuboot_agent": "a field of `tpuboot who --json` (tpuboot/holders/report.py)"}
#: A name of tpuboot's where PromQL would have one: not a file's (tpuboot_0.1.0_all.deb), a shell
#: function's (_tpuboot_clone) or a record rule's tail (instance:tpuboot_tpus_bound:sum).
METRIC_NAME = re.compile(r"(?<![\w:/.\-])tpuboot_[a-z0-9_]+(?!\.?[\w:\-])")


def documented_metrics(text: str) -> set[str]:
    return set(METRIC_NAME.findall(text)) - NOT_METRICS.keys()


@pytest.mark.parametrize(
    "page",
    [*pages(), MAN, CONF],
    ids=lambda p: p.relative_to(TOP).as_posix(),
)
def test_every_metric_a_page_names_is_declared(page: Path):
    """A metric the docs name is one tpuboot exports (renamed or gone, the page says so too)."""
    samples = {sample for metric in CATALOG for sample in (metric.name, *metric.samples)}
    text = plain(page.read_text()) if page == MAN else page.read_text()
    assert sorted(documented_metrics(text) - samples) == []


def test_the_metric_names_of_the_docs_are_found():
    text = (
        "`tpuboot_tpus{state}` and tpuboot_bind_attempts_total, not instance:tpuboot_tpus_bound:sum,"
        " tpuboot_0.1.0_all.deb, /tmp/tpuboot_x, _tpuboot_clone or `tpuboot_agent`; tpuboot_nope."
    )
    assert documented_metrics(text) == {"tpuboot_tpus", "tpuboot_bind_attempts_total", "tpuboot_nope"}


def test_the_monitoring_page_lists_every_alert_and_record_of_the_shipped_rules():
    rules = yaml.safe_load((TOP / "prometheus/tpuboot.rules.yml").read_text())
    names = [r.get("alert") or r.get("record") for group in rules["groups"] for r in group["rules"]]
    text = (DOC / "monitoring.md").read_text()
    assert "TpubootDown" in names and [n for n in names if f"`{n}`" not in text] == []


def test_man_page_says_the_package_runs_a_privileged_container():
    description = plain(man_sections()["DESCRIPTION"])
    assert re.search(r"privileged\s+container", description), "DESCRIPTION must say it plainly"
    assert "io.tpuboot.managed=1" in plain(MAN.read_text())


def test_package_description_says_it_runs_a_privileged_container():
    control = (TOP / "debian/control").read_text()
    description = control.split("\nDescription:", 1)[1]
    assert re.search(r"privileged\s+container", description)


def test_man_page_gives_every_signal_its_effect():
    """SIGNALS names each signal Linux has (the real-time ones as a range), each signal tpuboot
    gives a meaning in an item of its own, and what it says Python ignores is ignored."""
    from tpuboot import signals

    text = plain(man_sections()["SIGNALS"])
    # Linux's 16, SIGSTKFLT, is no Signals member before Python 3.11.
    named = sorted({"SIGSTKFLT", *(s.name for s in signal.valid_signals() if isinstance(s, signal.Signals))})
    assert {"SIGABRT", "SIGRTMIN", "SIGRTMAX"} <= set(named)
    assert [name for name in named if not re.search(rf"\b{name}\b", text)] == []
    tags = " ".join(tag for tag, _ in items("SIGNALS"))
    assert [s.name for s in (*signals.STOP, *signals.HELD) if not re.search(rf"\b{s.name}\b", tags)] == []
    assert signal.getsignal(signal.SIGXFSZ) == signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN


@pytest.mark.parametrize(
    "where", ["debian/control", "doc/tpuboot.8", "conf/tpuboot.yaml", "udev/tpuboot.rules"]
)
def test_each_list_of_the_tpus_bound_names_those_the_table_binds(where: str):
    """The man page, the package description, the shipped config and the udev rule list the
    generations tpuboot binds (they said v5p, v6e, TPU7x after v5e was bound too)."""
    bound = ", ".join(kind.name.removeprefix("TPU ") for kind in VFIO_KINDS)
    item = r"(?:v\d\w*|TPU\w+)"
    text = unwrapped(re.sub(r"^\s*#", "", (TOP / where).read_text(), flags=re.M))
    lists = re.findall(rf"\(({item}(?:, {item})+)[,)]", text)
    assert lists and set(lists) == {bound}, f"{where} lists {lists}; the table binds {bound}"


# --- README.md -------------------------------------------------------------------------------------


def prose(text: str) -> str:
    """README text outside code blocks (indented or fenced), where commands, not citations, live."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and not line.startswith("    "):
            kept.append(line)
    return "\n".join(kept)


def anchors(text: str) -> set[str]:
    """GitHub's anchors of the headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def relative_targets(text: str) -> list[str]:
    """Targets of Markdown links and of paths cited in the prose that are not URLs or anchors."""
    body = prose(text)
    links = re.findall(r"\]\(([^)\s]+)\)", body)
    cited = re.findall(r"(?<![\w/.])(\.\.?/[\w./-]+)", body)
    return [
        t
        for t in dict.fromkeys(links + cited)
        if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")
    ]


def outside_or_missing(text: str, base: Path = TOP) -> list[str]:
    """Relative targets of ``text`` (a page in directory ``base``) outside the repository or missing."""
    bad = []
    for target in relative_targets(text):
        path = (base / target.split("#")[0]).resolve()
        if TOP not in (path, *path.parents) or not path.exists():
            bad.append(target)
    return bad


def broken_anchors(text: str, base: Path = TOP) -> list[str]:
    """Links to ``#anchor`` of this page or of another page (``page.md#anchor``) with no such heading."""
    bad = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", prose(text)):
        page = (base / target).resolve() if target else None
        if page is not None and (page.suffix != ".md" or not page.exists()):
            continue  # not a Markdown page, or missing (outside_or_missing says so)
        if anchor not in anchors(page.read_text() if page is not None else text):
            bad.append(f"{target}#{anchor}")
    return bad


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(TOP).as_posix())
def test_pages_link_and_cite_only_files_in_the_repository(page: Path):
    text = page.read_text()
    assert outside_or_missing(text, page.parent) == []
    assert broken_anchors(text, page.parent) == []


def test_the_code_cites_only_files_in_the_repository():
    """A docstring or comment of tpuboot/ that cites ``../somewhere`` names a file a reader of the
    repository has (the notes the code was written from are not shipped)."""
    bad = {
        path.relative_to(TOP).as_posix(): found
        for path in sorted((TOP / "tpuboot").rglob("*.py"))
        if (found := [t for t in re.findall(r"(?<![\w/.])(\.\./[\w./-]+)", path.read_text())])
    }
    assert bad == {}


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(TOP).as_posix())
def test_paths_in_backticks_exist(page: Path):
    """`tpuboot/metrics.py`, `scripts/matrix/`: a path under one of the repository's own top-level
    directories names a file that is there."""
    tops = {p.name for p in TOP.iterdir() if p.is_dir() and not p.name.startswith(".git")}
    quoted = re.findall(r"`([^`\s]+)`", page.read_text())
    cited = [q for q in quoted if q.split("/")[0] in tops and "/" in q]
    assert [q for q in cited if not (TOP / q.split(":")[0]).exists()] == []


def test_the_readme_cites_the_repository_and_links_every_doc_page():
    text = README.read_text()
    assert re.search(r"`tpuboot/[\w/]+\.py`|`scripts/\w", text)
    linked = set(re.findall(r"\]\((doc/[\w.-]+)", text))
    assert [
        p.relative_to(TOP).as_posix() for p in DOC.glob("*.md") if p.relative_to(TOP).as_posix() not in linked
    ] == []


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("Sources: ../shared/notes/tpu-facts.md (facts)", ["../shared/notes/tpu-facts.md"]),
        ("see [the notes](../notes.md)", ["../notes.md"]),
        ("see [the page](doc/nothing.8)", ["doc/nothing.8"]),
        ("see [the page](doc/tpuboot.8) and [site](https://example.org/x) and [it](#tpuboot)", []),
        ("    apt install ./tpuboot_0.1.0_all.deb\n", []),
    ],
)
def test_readme_check_finds_paths_outside_the_repository(text, bad):
    assert outside_or_missing(text) == bad


def test_a_page_under_doc_is_checked_from_its_own_directory():
    assert outside_or_missing("see [the page](tpuboot.8) and [up](../README.md)", DOC) == []
    assert outside_or_missing("see [the page](doc/tpuboot.8)", DOC) == ["doc/tpuboot.8"]


def test_anchor_check_finds_a_missing_heading():
    assert broken_anchors("## Here\n[a](#here) [b](#gone) [c](operation.md#commands)", DOC) == ["#gone"]
    assert broken_anchors("[d](operation.md#no-such-part)", DOC) == ["operation.md#no-such-part"]


# --- doc/architecture.md ---------------------------------------------------------------------------

ARCHITECTURE = TOP / "doc/architecture.md"


def test_the_architecture_page_names_only_modules_and_classes_that_exist():
    """Each `tpuboot/...` path, each (package/module) of the diagram and each class it draws is
    there: the page cannot outlive a rename."""
    import importlib

    text = ARCHITECTURE.read_text()
    cited = re.findall(r"`(tpuboot/[\w/.]+)`", text)
    drawn = [f"tpuboot/{m}.py" for m in re.findall(r"\(((?:devices|env|containers)/\w+)\)", text)]
    assert len(drawn) >= 4 and [p for p in cited + drawn if not (TOP / p).exists()] == []
    classes = {
        "tpuboot.devices.manager": "DeviceManager", "tpuboot.devices.vfio": "Binder",
        "tpuboot.env.service": "EnvService", "tpuboot.env.sync": "EnvSync",
        "tpuboot.containers.service": "Containers", "tpuboot.containers.supervisor": "Supervisor",
        "tpuboot.gce.guestattrs": "Publisher", "tpuboot.gce.client": "MetadataClient",
    }  # fmt: skip
    for module, name in classes.items():
        assert name in text and hasattr(importlib.import_module(module), name), (module, name)


# --- doc/operation.md and the README: the commands ---------------------------------------------------


def operation_commands() -> str:
    return section(OPERATION, "Commands")


def test_the_operation_page_lists_every_command_with_its_options_and_global_option():
    text = operation_commands()
    rows = {
        m.group(1): m.group(0)
        for m in re.finditer(r"^\| `tpuboot ([a-z-]+(?: get)?)\b.*$", text, re.MULTILINE)
    }
    missing = []
    for path, parser in commands(cli.build_parser()):
        if path not in rows:
            missing.append(path)
            continue
        missing += [
            f"{path} {o}"
            for o in options(parser)
            if not re.search(rf"(?<![\w-]){re.escape(o)}\b", rows[path])
        ]
    parser = cli.build_parser()
    wanted = [o for a in parser._actions if not isinstance(a, argparse._HelpAction) for o in a.option_strings]
    missing += [o for o in wanted if not re.search(rf"(?<![\w-]){re.escape(o)}\b", text)]
    assert missing == []


def test_the_readme_lists_every_command_and_global_option():
    text = section(README, "Commands")
    missing = [path for path, _ in commands(cli.build_parser()) if not re.search(rf"\b{path}\b", text)]
    parser = cli.build_parser()
    wanted = [
        a.option_strings[0]
        for a in parser._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]
    assert missing + [o for o in wanted if f"`{o}" not in text] == []


@pytest.mark.parametrize("where", ["README", "doc/operation.md", "--help"])
def test_every_exit_status_is_listed(where: str):
    text = {
        "README": section(README, "Commands"),
        "doc/operation.md": operation_commands(),
        "--help": cli.build_parser().epilog or "",
    }[where]
    statuses = exit_statuses()
    assert 130 in statuses.values()
    assert [v for v in statuses.values() if not re.search(rf"(?<!\d){v} [a-z]", unwrapped(text))] == []


# --- figures the docs quote, from the code -------------------------------------------------------


def test_the_bind_retries_quoted_are_the_managers():
    """The number of retries, of tries, each wait and their sum, as README-level prose quotes them."""
    from tpuboot.config import VfioConfig
    from tpuboot.devices import manager

    retries = VfioConfig().retries
    waits = [manager.retry_delay(n) for n in range(1, retries + 1)]
    total = f"{sum(waits):g} s"
    operation = unwrapped(section(OPERATION, "How a bind works, and what it refuses"))
    assert f"({retries} by default, so {retries + 1} tries in all)" in operation
    assert ", ".join(f"{w:g} s" for w in waits) + f" ({total} in all" in operation
    assert f"at most {manager.BACKOFF_CAP:g} s" in operation
    ready = unwrapped(section(OPERATION, "READY and STATUS"))
    assert f"{retries} retries by default, {retries + 1} tries, {total} of backoff" in ready
    man = unwrapped(plain(man_sections()["CONFIGURATION"]))
    assert (
        f"{retries + 1} tries over {total} by default" in man and f"at most {manager.BACKOFF_CAP:g} s" in man
    )
    conf = unwrapped(re.sub(r"^\s*#", "", CONF.read_text(), flags=re.MULTILINE))
    assert f"{retries} retries are {retries + 1} tries over {total}" in conf


def test_the_metrics_endpoints_bounds_quoted_are_the_servers():
    from tpuboot import metrics_server

    text = unwrapped(section(DOC / "monitoring.md", "Metrics"))
    assert f"{metrics_server.MAX_CONNECTIONS} connections at once" in text
    assert f"cut {metrics_server.REQUEST_DEADLINE:g} s after it was accepted" in text
    assert f"a request over {metrics_server.MAX_REQUEST_BYTES // 1024} KiB" in text
    assert f"`LimitNOFILE={unit_directives()['LimitNOFILE'][0]}`" in text


def test_the_retry_waits_double_from_the_first_up_to_the_cap():
    from tpuboot.devices import manager

    waits = [manager.retry_delay(n) for n in range(1, 10)]
    assert waits[0] == manager.BACKOFF_FIRST and max(waits) == manager.BACKOFF_CAP
    assert all(b in (2 * a, manager.BACKOFF_CAP) for a, b in itertools.pairwise(waits))
    assert manager.retry_delay(10_000) == manager.BACKOFF_CAP  # no float overflow


def unit_directives() -> dict[str, list[str]]:
    directives: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if re.match(r"[A-Za-z]+=", line):
            key, _, value = line.partition("=")
            directives.setdefault(key, []).extend(value.split())
    return directives


def writable_paths() -> list[str]:
    """Every path the unit lets tpuboot write: ReadWritePaths= (a leading '-' only means "if it
    exists") and the directories systemd makes for StateDirectory=, CacheDirectory=, RuntimeDirectory=."""
    unit = unit_directives()
    paths = [p.lstrip("-") for p in unit["ReadWritePaths"]]
    for key, base in (
        ("StateDirectory", "/var/lib"),
        ("CacheDirectory", "/var/cache"),
        ("RuntimeDirectory", "/run"),
    ):
        paths += [f"{base}/{name}" for name in unit.get(key, [])]
    return paths


def test_the_unit_lets_tpuboot_write_what_the_docs_say():
    assert {"/etc", "/var/lib/tpuboot", "/run/tpuboot", "/sys/bus/pci"} <= set(writable_paths())


@pytest.mark.parametrize("where", ["man", "doc/security.md", "conf/tpuboot.yaml"])
def test_every_writable_path_is_documented(where: str):
    """The man page's SECURITY, the security page's list and the shipped config's header name each
    path the unit lets tpuboot write (the config's header: the file system's, not sysfs)."""
    text = {
        "man": plain(man_sections()["SECURITY"]),
        "doc/security.md": section(DOC / "security.md", "The service's sandbox"),
        "conf/tpuboot.yaml": CONF.read_text().split("\n\n", 1)[0],
    }[where]
    paths = [p for p in writable_paths() if where != "conf/tpuboot.yaml" or not p.startswith("/sys/")]
    assert [p for p in paths if not re.search(rf"{re.escape(p)}(?![\w/-])", text)] == []


def purged_paths() -> list[str]:
    """What the postrm's purge removes with rm -rf (directories), under ${DPKG_ROOT:-}."""
    purge = POSTRM.read_text().split("\npurge)", 1)[1].split(";;", 1)[0]
    return re.findall(r'rm -rf "\$\{DPKG_ROOT:-\}(/[^"]+)"', purge)


@pytest.mark.parametrize("where", ["man", "doc/package.md"])
def test_every_path_the_purge_removes_is_documented(where: str):
    text = {
        "man": plain(man_sections()["REMOVING THE PACKAGE"]),
        "doc/package.md": section(DOC / "package.md", "Purge"),
    }[where]
    paths = purged_paths()
    assert {"/var/lib/tpuboot", "/run/tpuboot"} <= set(paths)
    assert [p for p in paths if p not in text] == []
    assert "textfile" in text, "what a purge leaves: the metrics textfile"


def test_the_readme_status_line_is_what_a_default_install_shows(kernel_with_tpus, emulator, root):
    """A daemon of the default configuration (env, vBar, GKE check on; the metadata server and a
    dockerd answering) says the README's STATUS line, numbers aside."""
    from tests.unit.fakes.dockerd import fake_dockerd
    from tests.unit.helpers.containers import engine_of
    from tests.unit.helpers.daemon import make, serving, until
    from tpuboot.config import MetadataConfig, MetricsConfig, VbarConfig

    shown = re.search(r'Status: "([^"]+)"', section(README, "On a running TPU VM"))
    assert shown is not None
    pattern = re.sub(r"\d+", r"\\d+", re.escape(shown.group(1)))
    config = Config(
        metadata=MetadataConfig(host=emulator.host, timeout=2.0, boot_deadline=5.0, watch=False),
        vbar=VbarConfig(registries=(*VbarConfig().registries, "example.invalid")),
        metrics=MetricsConfig(enabled=False),
    )
    assert (config.gke, config.env.enabled, config.vbar.enabled) == ("auto", True, True)  # the defaults
    with fake_dockerd() as dockerd:
        dockerd.images.update({config.vbar.image, "example.invalid/vbar:1.0"})
        daemon, _, _ = make(kernel_with_tpus, config=config, root=root, engine=engine_of(dockerd))
        with serving(daemon) as running:
            until(lambda: daemon.ready and "vBar: running" in daemon.status_line())  # READY: tpu-env synced
            line = daemon.status_line()
            running.stop()
    assert re.fullmatch(pattern, line), (shown.group(1), line)


@pytest.fixture
def kernel_with_tpus(tmp_path: Path):
    from tests.unit.fakes.kernel import FakeKernel
    from tests.unit.helpers.devices import V5P, add_tpu

    k = FakeKernel(tmp_path / "kernel")
    for i in range(4):
        add_tpu(k, f"0000:00:0{4 + i}.0", V5P, driver=None, group=str(4 + i))
    return k


def paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(TOP).as_posix())
def test_every_instruction_count_says_how_it_was_measured(page: Path):
    """An instruction count (`79 M instructions`, `icount, M instructions`) stands in a paragraph or
    table that names its method: valgrind on the host, or the icount guest."""
    unmeasured = [
        p.strip().splitlines()[0]
        for p in paragraphs(page.read_text())
        if re.search(r"\d+ M\b.*instructions|instructions.*\d+ M\b", p, re.DOTALL)
        and not re.search(r"valgrind|icount", p)
    ]
    assert unmeasured == []


def shallow() -> bool:
    """A shallow clone lacks the history the figures name."""
    done = subprocess.run(
        ["git", "-C", str(TOP), "rev-parse", "--is-shallow-repository"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() != "false"


def test_every_table_of_figures_names_its_date_and_commit():
    """Each table of doc/performance.md follows a paragraph giving the date and the tree it was
    measured on; the commits it names exist (when this is a git checkout with its history)."""
    text = (DOC / "performance.md").read_text()
    blocks = paragraphs(text)
    named: list[str] = []
    for i, block in enumerate(blocks):
        if not block.lstrip().startswith("|"):
            continue
        before = blocks[i - 1]
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", before) and re.search(r"\b[0-9a-f]{7}\b", before), (
            f"a table without its date and commit after: {before[:80]!r}"
        )
        named += re.findall(r"\b[0-9a-f]{7}\b", before)
    assert named
    if (TOP / ".git").exists() and shutil.which("git") and not shallow():

        def known(commit: str) -> bool:
            check = ["git", "-C", str(TOP), "cat-file", "-e", f"{commit}^{{commit}}"]
            return subprocess.run(check, capture_output=True, check=False).returncode == 0

        unknown = [c for c in set(named) if not known(c)]
        assert unknown == []


def test_every_configuration_section_is_explained_on_a_page():
    text = "\n".join(p.read_text() for p in pages())
    assert [name for name in Config.options if not re.search(rf"`{name}[.:`]", text)] == []
