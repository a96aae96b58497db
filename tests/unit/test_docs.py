"""The documentation against the code it describes, so the two cannot drift apart:

- conf/tpuboot.yaml shows every section and key of tpuboot/config.py, commented out, with its
  default and a line saying what it is;
- the man page has every command and option of the argparse parser in tpuboot/cli.py, every exit
  status the CLI returns, every configuration key and every metric (the README every metric too);
- README.md links and cites only files inside the repository;
- the man page and the package description say that the package runs privileged containers.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tpuboot import cli, metrics
from tpuboot.config import Config, MatchRule, Section, parse_config
from tpuboot.devices.table import DeviceTable
from tpuboot.metrics import Metrics
from tpuboot.paths import Root

TOP = Path(__file__).resolve().parents[2]
CONF = TOP / "conf/tpuboot.yaml"
MAN = TOP / "doc/tpuboot.8"
README = TOP / "README.md"


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


def commands(
    parser: argparse.ArgumentParser, prefix: str = ""
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(``metadata get``, its parser) for every command that runs something."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                path = f"{prefix}{name}"
                if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    yield from commands(sub, path + " ")
                else:
                    yield path, sub


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


def test_man_page_and_readme_list_every_metric(tmp_path):
    with metrics.use(Metrics()) as fresh:
        metrics.watch_pcie(Root(tmp_path), DeviceTable())  # the daemon's collector, names and all
        exposition = fresh.exposition()
    families = [
        line.split()[2]
        for line in exposition.decode().splitlines()
        if line.startswith("# TYPE ") and not line.split()[2].endswith("_created")
    ]
    assert "tpuboot_pcie_present" in families
    assert "tpuboot_tpus" in families
    man = plain(man_sections()["METRICS"])
    readme = README.read_text().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    assert {
        "man": [f for f in families if f not in man],
        "README": [f for f in families if f not in readme],
    } == {
        "man": [],
        "README": [],
    }


def test_man_page_says_the_package_runs_a_privileged_container():
    description = plain(man_sections()["DESCRIPTION"])
    assert re.search(r"privileged\s+container", description), "DESCRIPTION must say it plainly"
    assert "io.tpuboot.managed=1" in plain(MAN.read_text())


def test_package_description_says_it_runs_a_privileged_container():
    control = (TOP / "debian/control").read_text()
    description = control.split("\nDescription:", 1)[1]
    assert re.search(r"privileged\s+container", description)


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


def outside_or_missing(text: str) -> list[str]:
    bad = []
    for target in relative_targets(text):
        path = (TOP / target.split("#")[0]).resolve()
        if TOP not in (path, *path.parents) or not path.exists():
            bad.append(target)
    return bad


def test_readme_links_and_cites_only_files_in_the_repository():
    text = README.read_text()
    assert outside_or_missing(text) == []
    assert [a for a in re.findall(r"\]\(#([^)]+)\)", text) if a not in anchors(text)] == []


def test_readme_paths_in_backticks_exist():
    """`tpuboot/metrics.py`, `scripts/matrix/`: a path under one of the repository's own top-level
    directories names a file that is there."""
    tops = {p.name for p in TOP.iterdir() if p.is_dir() and not p.name.startswith(".git")}
    quoted = re.findall(r"`([^`\s]+)`", README.read_text())
    cited = [q for q in quoted if q.split("/")[0] in tops and "/" in q]
    assert cited and [q for q in cited if not (TOP / q.split(":")[0]).exists()] == []


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
        "tpuboot.guestattrs": "Publisher", "tpuboot.env.metadata": "MetadataClient",
    }  # fmt: skip
    for module, name in classes.items():
        assert name in text and hasattr(importlib.import_module(module), name), (module, name)
