"""The image-build examples under examples/: the Packer template passes the validation of the
Packer Debian 12 ships (googlecompute built in: the full check, not only the syntax) for Ubuntu
22.04 (its default) and Debian 12, and the cloud-init user-data installs the .deb and runs
prepare-image, keeping its verdict.

The cloud-init path runs for real in tests/vm/test_tpuboot_cloudinit.py, with user-data of its own
(the same steps); this file is only read here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TEMPLATE = EXAMPLES / "packer/tpuboot-image.pkr.hcl"
PACKER = shutil.which("packer")
needs_packer = pytest.mark.skipif(PACKER is None, reason="packer not installed (scripts/host-packages.txt)")


def validate(tmp_path: Path, *variables: str) -> subprocess.CompletedProcess[str]:
    assert PACKER is not None
    return subprocess.run(
        [PACKER, "validate", *(a for v in variables for a in ("-var", v)), str(TEMPLATE)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CHECKPOINT_DISABLE": "1"},
        check=False,
    )


#: The source images the README documents: the template's default (Ubuntu 22.04) and Debian 12.
SOURCES = {
    "ubuntu-2204": (),
    "debian-12": ("source_image_family=debian-12", "source_image_project=debian-cloud"),
}


@needs_packer
@pytest.mark.parametrize("source", SOURCES)
def test_the_packer_template_validates(tmp_path: Path, source: str) -> None:
    deb = tmp_path / "tpuboot_1.0_all.deb"
    deb.write_bytes(b"!<arch>\n")
    done = validate(tmp_path, "project_id=my-project", f"deb={deb}", *SOURCES[source])
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_packer_template_builds_ubuntu_2204_by_default() -> None:
    text = TEMPLATE.read_text()
    defaults = dict(re.findall(r'variable "(\w+)" \{[^}]*?default\s*=\s*"([^"]*)"', text, re.DOTALL))
    assert (defaults["source_image_family"], defaults["source_image_project"]) == (
        "ubuntu-2204-lts",
        "ubuntu-os-cloud",
    )


@needs_packer
def test_validation_is_real(tmp_path: Path) -> None:
    """The same template with the .deb missing fails: validate reads the provisioners."""
    done = validate(tmp_path, "project_id=my-project", f"deb={tmp_path / 'missing.deb'}")
    assert done.returncode == 1
    assert "missing.deb: no such file or directory" in " ".join((done.stdout + done.stderr).split())


def test_the_packer_template_installs_the_deb_and_runs_prepare_image() -> None:
    """In the README's order: universe on Ubuntu, docker.io with the .deb, then prepare-image."""
    text = TEMPLATE.read_text()
    universe = text.index("add-apt-repository -y universe")
    install = text.index("apt-get install -y docker.io /tmp/tpuboot.deb")
    assert universe < install < text.index('"sudo tpuboot prepare-image"')


def test_the_cloud_init_user_data_installs_then_prepares() -> None:
    text = (EXAMPLES / "cloud-init/user-data.yaml").read_text()
    assert text.startswith("#cloud-config\n")
    data = yaml.safe_load(text)
    steps = [" ".join(step) if isinstance(step, list) else step for step in data["runcmd"]]
    install = next(i for i, s in enumerate(steps) if s.startswith("apt-get install") and "tpuboot.deb" in s)
    prepare = next(i for i, s in enumerate(steps) if "tpuboot prepare-image --json" in s)
    assert install < prepare
    assert "docker.io" in data["packages"]
