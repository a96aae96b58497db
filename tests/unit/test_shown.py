"""A value a message quotes, cut short (tpuboot/errors.py ``shown``): one rule, and every message
that quotes a value from a file or the metadata server gives the same text for it."""

from __future__ import annotations

import pytest

from tpuboot.configfields import parse_hex_id, parse_seconds
from tpuboot.env.tpuenv import parse_tpu_env
from tpuboot.errors import ConfigError, shown
from tpuboot.references import ImageRefused, RegistryAllowlist
from tpuboot.slice.shape import read_slice

LONG = "x" * 5000 + "'\n"


@pytest.mark.parametrize(
    ("value", "most", "expected"),
    [
        ("short", 40, "'short'"),
        ("a" * 38, 40, "'" + "a" * 38 + "'"),  # 40 characters with its quotes: whole
        ("a" * 39, 40, "'" + "a" * 36 + "..."),  # 41: cut to 40
        (10**100, 40, "1" + "0" * 36 + "..."),
        ("\x1b[2J" * 3, 40, repr("\x1b[2J" * 3)),  # escaped, so a terminal shows it as text
        ("b" * 200, 120, "'" + "b" * 116 + "..."),
    ],
)
def test_the_repr_is_cut_to_most_characters(value: object, most: int, expected: str) -> None:
    assert shown(value, most) == expected
    assert len(shown(value, most)) <= most


def test_a_config_value_is_quoted_by_the_one_rule() -> None:
    for parse in (parse_hex_id, parse_seconds(60.0)):
        with pytest.raises(ConfigError) as caught:
            parse(LONG, "tpuboot.yaml: x")
        assert f"tpuboot.yaml: x: {shown(LONG)} is not" in str(caught.value)


def test_an_image_reference_is_quoted_by_the_one_rule() -> None:
    with pytest.raises(ImageRefused) as caught:
        RegistryAllowlist((), "containers.registries").check(LONG)
    assert str(caught.value).startswith(f"image {shown(LONG, 120)} refused")


def test_a_tpu_env_key_and_a_slice_value_are_quoted_by_the_one_rule() -> None:
    key = "not a name " * 10
    parsed = parse_tpu_env(f'"{key}": "1"\nACCELERATOR_TYPE: "1"\n')
    assert shown(key) in parsed.skipped
    reading = read_slice({"ACCELERATOR_TYPE": LONG}, None)
    assert any(shown(LONG.strip()) in warning for warning in reading.warnings)
