"""The parsed-config cache (tpuboot/configcache.py): an unchanged file loads without PyYAML, and
nothing about the cache (its absence, corruption, a link, a failed write) changes what a load
gives or the error it raises."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpuboot import configcache
from tpuboot.config import Config, VfioConfig, load_config, parse_config
from tpuboot.configcache import CACHE_PATH, MAX_BYTES, MISS, lookup, plain, store
from tpuboot.errors import ConfigError
from tpuboot.paths import Root

REPO = Path(__file__).resolve().parents[2]
CONFIG = "/etc/tpuboot/tpuboot.yaml"
TEXT = (
    "# the bench's kind of file\n"
    "devices:\n- {vendor: 0x1234, device: '11e8', name: edu}\n"
    "vfio: {node_mode: '0660', retries: 3, node_timeout: 2.5}\n"
    "metadata: {watch: no}\n"
    "env:\n  environment: {A: 'x y', B: ''}\n"
)
EXPECTED = parse_config(TEXT, CONFIG)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "etc/tpuboot").mkdir(parents=True)
    (tmp_path / CONFIG.lstrip("/")).write_text(TEXT)
    return tmp_path


def cache_file(tree: Path) -> Path:
    return tree / CACHE_PATH.lstrip("/")


def record(tree: Path) -> dict:
    return json.loads(cache_file(tree).read_bytes())


def child(tree: Path, path: str | None = None, user: int | None = None) -> tuple[str, bool]:
    """load_config in a fresh interpreter: (repr of the result or the error, whether yaml was imported)."""
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from tpuboot.config import load_config\nfrom tpuboot.paths import Root\n"
        "try:\n"
        f"    out = repr(load_config(Root({str(tree)!r}), {path!r}))\n"
        "except Exception as exc:\n"
        "    out = f'{type(exc).__name__}: {exc}'\n"
        "print(out)\nprint('yaml' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True, timeout=120, user=user
    )
    out, imported = done.stdout.splitlines()
    return out, imported == "True"


# --- hit and miss -----------------------------------------------------------------------------


def test_an_unchanged_file_loads_from_the_cache_without_importing_yaml(tree):
    assert child(tree) == (repr(EXPECTED), True)  # the first load parses and keeps the result
    assert record(tree)["text"] == TEXT
    assert child(tree) == (repr(EXPECTED), False)
    assert load_config(Root(tree)) == EXPECTED


def test_the_record_is_0600_and_holds_the_text_and_what_yaml_made_of_it(tree):
    load_config(Root(tree))
    assert cache_file(tree).stat().st_mode & 0o777 == 0o600
    kept = record(tree)
    assert (kept["format"], kept["text"]) == (configcache.FORMAT, TEXT)
    assert kept["data"]["devices"] == [{"vendor": 0x1234, "device": "11e8", "name": "edu"}]
    assert kept["data"]["metadata"] == {"watch": False}


def test_a_change_of_any_one_character_is_a_miss(tree):
    load_config(Root(tree))
    data = lookup(Root(tree), TEXT)
    assert data is not MISS
    for at in range(len(TEXT)):
        changed = TEXT[:at] + chr(ord(TEXT[at]) ^ 1) + TEXT[at + 1 :]
        assert lookup(Root(tree), changed) is MISS, at
    for other in (TEXT[:-1], TEXT + "\n", TEXT + " ", "\ufeff" + TEXT):
        assert lookup(Root(tree), other) is MISS


def test_an_edited_file_is_parsed_again_and_its_result_kept(tree):
    load_config(Root(tree))
    (tree / CONFIG.lstrip("/")).write_text(TEXT.replace("retries: 3", "retries: 4"))
    assert child(tree)[1] is True
    assert load_config(Root(tree)).vfio.retries == 4
    assert record(tree)["data"]["vfio"]["retries"] == 4
    assert child(tree) == (repr(EXPECTED.replace(vfio=EXPECTED.vfio.replace(retries=4))), False)


def test_another_pyyaml_format_or_version_is_a_miss(tree, monkeypatch):
    load_config(Root(tree))
    kept = record(tree)
    for key, value in (("yaml", ["/elsewhere/yaml/__init__.py", 1, 2]), ("format", 2), ("tpuboot", "0.0.1")):
        cache_file(tree).write_text(json.dumps({**kept, key: value}))
        assert lookup(Root(tree), TEXT) is MISS, key
    cache_file(tree).write_text(json.dumps(kept))
    assert lookup(Root(tree), TEXT) == kept["data"]
    monkeypatch.setattr(configcache, "_yaml_stamp", lambda: None)  # no PyYAML installed
    assert lookup(Root(tree), TEXT) is MISS


def test_a_file_of_comments_writes_no_cache(tree):
    (tree / CONFIG.lstrip("/")).write_text("# nothing set\n")
    assert load_config(Root(tree)) == Config()
    assert not (tree / "var").exists()


# --- a bad cache is a miss, never an error -------------------------------------------------------


def corruptions(good: bytes) -> dict[str, bytes]:
    kept = json.loads(good)
    return {
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "one byte short": good[:-1],
        "not json": b"\x00\xffnot json",
        "not utf-8": good.replace(b'"text"', b'"t\xffxt"'),
        "a list": b"[1, 2]",
        "no data": json.dumps({k: v for k, v in kept.items() if k != "data"}).encode(),
        "format as a string": json.dumps({**kept, "format": "1"}).encode(),
        "format true": json.dumps({**kept, "format": True}).encode(),
        "text not a string": json.dumps({**kept, "text": None}).encode(),
        "NaN": json.dumps({**kept, "data": {"vfio": {"retries": float("nan")}}}).encode(),
        "deeply nested": b"[" * 200_000 + b"]" * 200_000,
    }


@pytest.mark.parametrize("case", corruptions(b"{}"))
def test_a_corrupt_record_is_a_miss_and_the_file_is_parsed(tree, case):
    load_config(Root(tree))
    bad = corruptions(cache_file(tree).read_bytes())[case]
    cache_file(tree).write_bytes(bad)
    assert lookup(Root(tree), TEXT) is MISS
    assert load_config(Root(tree)) == EXPECTED
    assert record(tree)["text"] == TEXT  # the parse wrote a good record over it


def test_an_oversized_record_is_not_read(tree):
    load_config(Root(tree))
    good = cache_file(tree).read_bytes()
    cache_file(tree).write_bytes(good + b" " * (MAX_BYTES - len(good)))  # valid JSON at the limit
    assert lookup(Root(tree), TEXT) is not MISS
    cache_file(tree).write_bytes(good + b" " * (MAX_BYTES + 1 - len(good)))
    assert lookup(Root(tree), TEXT) is MISS
    assert load_config(Root(tree)) == EXPECTED


def test_a_huge_config_is_not_cached(tree):
    text = TEXT + "# " + "x" * MAX_BYTES + "\n"
    (tree / CONFIG.lstrip("/")).write_text(text)
    assert load_config(Root(tree)) == EXPECTED
    assert not cache_file(tree).exists()


def test_a_symlinked_record_or_directory_is_not_followed(tree, tmp_path_factory):
    """Each link leads to a good record for this very text: followed, it would be a hit."""
    load_config(Root(tree))
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    good = cache_file(tree).read_bytes()
    os.replace(cache_file(tree), elsewhere / "config.json")
    cache_file(tree).symlink_to(elsewhere / "config.json")
    assert lookup(Root(tree), TEXT) is MISS
    assert load_config(Root(tree)) == EXPECTED
    # The write is atomicfile's: an absolute link resolves under the Root, as in a chroot, so
    # nothing outside the tree is written; the read still does not follow the link.
    assert (elsewhere / "config.json").read_bytes() == good
    assert lookup(Root(tree), TEXT) is MISS

    shutil.rmtree(cache_file(tree).parent)
    (elsewhere / "tpuboot").mkdir()
    (elsewhere / "tpuboot/config.json").write_bytes(good)
    cache_file(tree).parent.symlink_to(elsewhere / "tpuboot")
    assert lookup(Root(tree), TEXT) is MISS


@pytest.mark.parametrize(("what", "mode"), [("record", 0o622), ("record", 0o606), ("directory", 0o777)])
def test_a_record_others_could_have_written_is_not_used(tree, what, mode):
    load_config(Root(tree))
    target = cache_file(tree) if what == "record" else cache_file(tree).parent
    target.chmod(mode)
    assert lookup(Root(tree), TEXT) is MISS
    assert load_config(Root(tree)) == EXPECTED


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_another_users_record_is_not_used(tree):
    load_config(Root(tree))
    os.chown(cache_file(tree), 65534, 65534)
    assert lookup(Root(tree), TEXT) is MISS


def test_a_record_that_is_a_fifo_or_a_directory_is_a_miss(tree):
    cache_file(tree).parent.mkdir(parents=True)
    os.mkfifo(cache_file(tree))  # O_NONBLOCK: opening it does not wait for a writer
    assert lookup(Root(tree), TEXT) is MISS
    assert load_config(Root(tree)) == EXPECTED  # the write replaced the fifo
    cache_file(tree).unlink()
    cache_file(tree).mkdir()
    assert load_config(Root(tree)) == EXPECTED  # the write fails (a directory in the way): ignored
    assert cache_file(tree).is_dir()


@pytest.mark.parametrize("blocker", ["var/cache", "var/cache/tpuboot"])
def test_a_failed_write_is_ignored(tree, blocker):
    """A file where a directory must be: atomicfile's write fails; the load does not."""
    (tree / blocker).parent.mkdir(parents=True, exist_ok=True)
    (tree / blocker).write_text("not a directory")
    assert load_config(Root(tree)) == EXPECTED
    assert (tree / blocker).read_text() == "not a directory"


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a command as another user: needs root")
def test_a_user_who_can_neither_read_nor_write_the_cache_just_parses():
    """The record is root's 0600: another user's command cannot read it, nor write one, and parses."""
    top = Path(tempfile.mkdtemp(prefix="tpuboot-configcache-"))  # pytest's own tmp is root's 0700
    try:
        top.chmod(0o755)
        (top / "etc/tpuboot").mkdir(parents=True)
        (top / CONFIG.lstrip("/")).write_text(TEXT)
        load_config(Root(top))
        before = cache_file(top).read_bytes()
        assert child(top, user=65534) == (repr(EXPECTED), True)
        assert cache_file(top).read_bytes() == before
        assert child(top) == (repr(EXPECTED), False)  # root's next command still hits
    finally:
        shutil.rmtree(top)


def test_an_unwritable_cache_directory_is_not_tried(tree, monkeypatch):
    """_may_write says no: atomicfile (29 M instructions) is not imported for a write that would fail."""
    cache_file(tree).parent.mkdir(parents=True)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    monkeypatch.delitem(sys.modules, "tpuboot.atomicfile", raising=False)
    store(Root(tree), TEXT, {"vfio": {}})
    assert "tpuboot.atomicfile" not in sys.modules
    assert not cache_file(tree).exists()


# --- what is kept --------------------------------------------------------------------------------

NOT_PLAIN = {
    "an int key": "vfio: {1: a}\n",
    "a bool key": "vfio: {yes: 1}\n",
    "a null key": "vfio: {~: 1}\n",
    "a date": "vfio: {node_timeout: 2001-02-03}\n",
    "a timestamp": "vfio: {node_timeout: 2001-02-03 04:05:06}\n",
    "bytes": "vfio: {node_mode: !!binary aGk=}\n",
    "a set": "vfio: !!set {a, b}\n",
    "NaN": "vfio: {retries: .nan}\n",
    "infinity": "vfio: {retries: -.inf}\n",
    "a cycle": "devices: &a [*a]\n",
    "an alias bomb": "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    + "".join(f"{n}: &{n} [{', '.join(['*' + p] * 10)}]\n" for p, n in zip("abcd", "bcde", strict=True)),
}


@pytest.mark.parametrize("case", NOT_PLAIN)
def test_yaml_data_json_cannot_carry_exactly_is_never_cached(tree, case):
    (tree / CONFIG.lstrip("/")).write_text(NOT_PLAIN[case])
    with pytest.raises(ConfigError) as fresh:
        parse_config(NOT_PLAIN[case], CONFIG)
    with pytest.raises(ConfigError) as loaded:
        load_config(Root(tree))
    assert str(loaded.value) == str(fresh.value)
    assert not cache_file(tree).exists()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=30,
)


def same(a: object, b: object) -> bool:
    """Equal and of the same types all the way down (1 == 1.0 == True for ==)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)  # type: ignore[index]
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    return repr(a) == repr(b) if isinstance(a, float) else a == b


@settings(deadline=None, max_examples=100)
@given(JSON_VALUES)
def test_what_plain_accepts_comes_back_from_the_record_identical(tmp_path_factory, data):
    root = Root(tmp_path_factory.mktemp("plain"))
    assert plain(data)
    store(root, "t: 1\n", data)
    back = lookup(root, "t: 1\n")
    assert back is not MISS and same(back, data)


def test_plain_refuses_what_json_would_change():
    for value in ({1: "a"}, ("a",), {"a": (1,)}, float("nan"), float("inf"), b"x", {"a"}, 1j, object()):
        assert not plain(value), value
    loop: list[object] = []
    loop.append(loop)
    assert not plain(loop)
    assert plain({"a": [1, 2.5, "x", None, True, {"b": []}]})


# --- validation: the same result and the same error, with or without the cache ------------------

INVALID = [
    "vfio: {nodemode: '0600'}\n",
    "colour: blue\n",
    "devices: [{vendor: 0x1234}]\n",
    "vfio: {node_mode: 666}\n",
    "metadata: {boot_deadline: 600}\n",
    "supervisor: {backoff_initial: 10, backoff_max: 5}\n",
    "vbar: {image: 'tpuboot-test/vbar:1'}\n",
    "vfio: [1]\n",
    "~\nfoo: 1\n",
]


@pytest.mark.parametrize("text", INVALID)
def test_a_config_that_fails_validation_fails_the_same_from_the_cache(tree, text):
    (tree / CONFIG.lstrip("/")).write_text(text)
    with pytest.raises(ConfigError) as fresh:
        parse_config(text, CONFIG)
    with pytest.raises(ConfigError) as first:
        load_config(Root(tree))
    kept = lookup(Root(tree), text)
    if kept is MISS:  # not kept only where YAML itself failed or json cannot carry the data
        assert not cache_file(tree).exists()
    with pytest.raises(ConfigError) as second:
        load_config(Root(tree))
    assert str(fresh.value) == str(first.value) == str(second.value)
    out, imported = child(tree)
    assert out == f"ConfigError: {fresh.value}"
    assert imported is (kept is MISS)


def test_text_yaml_cannot_read_is_never_kept(tree):
    (tree / CONFIG.lstrip("/")).write_text("vfio: {node_mode: '0666'\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(Root(tree))
    assert not cache_file(tree).exists()


def test_an_explicit_config_path_is_cached_the_same_way(tree):
    (tree / "other.yaml").write_text("vfio: {node_mode: '0600'}\n")
    assert load_config(Root(tree), "/other.yaml") == Config(vfio=VfioConfig(node_mode=0o600))
    assert child(tree, "/other.yaml") == (repr(Config(vfio=VfioConfig(node_mode=0o600))), False)
    assert child(tree) == (repr(EXPECTED), True)  # one record: the other file's text replaced it


# --- concurrency and the Root ---------------------------------------------------------------------


def test_two_writers_at_once_leave_one_whole_record(tree):
    """Each write is a new temp file renamed over the name: a reader sees one record or the other,
    never a mix, and what it is given is always its own text's data."""
    import yaml

    texts = (TEXT, TEXT + "ready: {}\n")
    datas = {text: yaml.safe_load(text) for text in texts}
    start = threading.Barrier(3)
    wrong: list[object] = []

    def write(text: str) -> None:
        start.wait()
        for n in range(150):
            # a distinct payload each time, so no write is skipped as unchanged
            store(Root(tree), text, {**datas[text], "metrics": {"port": 1000 + n}})

    def read() -> None:
        start.wait()
        for _ in range(300):
            for text in texts:
                got = lookup(Root(tree), text)
                if got is not MISS and {k: v for k, v in got.items() if k != "metrics"} != datas[text]:
                    wrong.append(got)

    threads = [threading.Thread(target=write, args=(t,)) for t in texts] + [threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
    final = record(tree)
    assert final["text"] in texts and final["data"]["metrics"] == {"port": 1149}
    assert [p.name for p in cache_file(tree).parent.iterdir()] == ["config.json"]  # no temp file left


def test_the_cache_lives_under_the_root(tree, tmp_path_factory):
    load_config(Root(tree))
    assert cache_file(tree).is_file()
    other = tmp_path_factory.mktemp("other")
    (other / "etc/tpuboot").mkdir(parents=True)
    (other / CONFIG.lstrip("/")).write_text(TEXT)
    assert lookup(Root(other), TEXT) is MISS  # another root has its own cache
    assert load_config(Root(other)) == EXPECTED
    assert (other / CACHE_PATH.lstrip("/")).is_file()


def test_prepare_image_leaves_the_images_config_cached(tree, capsys):
    """prepare-image loads the image's config like any command: the first boot finds the record
    warm (and instance-state, which removes what is this VM's, keeps it: it is the image's)."""
    from tpuboot import cli

    cli.main(["--root", str(tree), "prepare-image"])
    assert "instance-state" in capsys.readouterr().out
    assert record(tree)["text"] == TEXT
    assert child(tree) == (repr(EXPECTED), False)
