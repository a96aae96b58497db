"""`tpuboot env` on tpu-env documents an attacker or an unlucky operator could write: one result
line (on stderr, as the service logs it) and an exit status, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.mds_emulator import ALIAS_BOMB, MetadataEmulator
from tpuboot import cli

CASES = {
    "unbuildable dates and numbers": ("A: 2026-02-30\nB: !!int ''\nC: " + "9" * 5000 + "\n", cli.EXIT_OK, 3),
    "other tags": ("A: !!python/name:os.system ''\nB: !!binary aGk=\nC: ok\n", cli.EXIT_OK, 1),
    "a value over 128 KiB": (f"BIG: '{'x' * (128 * 1024)}'\nC: ok\n", cli.EXIT_OK, 1),
    "refused names": ("LD_PRELOAD: /x.so\nBASH_ENV: /x\nTMPDIR: /x\nC: ok\n", cli.EXIT_OK, 1),
    "alias bomb": (ALIAS_BOMB, cli.EXIT_FAILED, None),
    "a tagged document": ("--- !!set {A, B}\n", cli.EXIT_FAILED, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tpuboot_env_answers_every_document_with_one_line(
    name: str, emulator: MetadataEmulator, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    """Before: the first case ended `tpuboot env` with a ValueError traceback."""
    text, status, keys = CASES[name]
    monkeypatch.setenv("GCE_METADATA_HOST", emulator.host)
    emulator.set_attribute("tpu-env", text)
    top = tmp_path / "root"
    (top / "etc").mkdir(parents=True)
    assert cli.main(["--root", str(top), "env", "--deadline", "5"]) == status
    said = capsys.readouterr()
    assert said.out == "" and "Traceback" not in said.err, said
    results = [line for line in said.err.splitlines() if line.startswith("tpuboot: tpu-env: ")]
    if keys is None:
        (result,) = [line for line in results if "no cached copy" in line]
        assert result.startswith("tpuboot: tpu-env: metadata tpu-env is invalid and no cached copy; left ")
    else:
        assert results[-1] == f"tpuboot: tpu-env: {keys} key{'s' if keys > 1 else ''} from metadata"
        assert not [line for line in results if line.endswith(" from metadata")][:-1]  # said once
        assert len((top / "home/tpu-runtime/tpu-env").read_text().splitlines()) == keys
