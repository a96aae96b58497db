"""Unit tests of the VM harness's pure parts (harness/vm/: artifacts, kernel images, the guest
command channel, the QEMU command line): no root, no QEMU, no network.

They run with ``-m "not vm"``, so a broken parser shows up before a slow boot.
"""

from __future__ import annotations

import base64
import importlib.util
import lzma
import os
import stat
import struct
from pathlib import Path
from types import ModuleType

import pytest

from harness.vm import artifacts, hostenv, kernelimage
from harness.vm.guestcmd import CommandFailed, Result
from harness.vm.machine import VM

GUEST = artifacts.GUEST_DIR


def _load_guest(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"guest_{name}", GUEST / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- apt sources


def test_apt_sources_reads_one_line_and_deb822(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text(
        "# comment\ndeb-src http://mirror.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k/one.gpg] http://mirror.example/debian bookworm main contrib\n"
    )
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://other.example/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\nSigned-By: /k/two.gpg\n\n"
        "Types: deb\nURIs: http://off.example/debian\nSuites: trixie\nComponents: main\nEnabled: no\n"
    )
    (tmp_path / "sources.list.d" / "ignored.list.disabled").write_text(
        "deb http://no.example/ bookworm main\n"
    )
    sources = hostenv.apt_sources(tmp_path)
    assert [s.uri for s in sources] == ["http://mirror.example/debian", "http://other.example/debian"]
    assert sources[0].signed_by == "/k/one.gpg" and sources[0].components == ("main", "contrib")
    assert sources[1].suites == ("bookworm", "bookworm-updates")
    assert hostenv.debian_mirror("bookworm", tmp_path).uri == "http://mirror.example/debian"
    with pytest.raises(hostenv.HostError, match="trixie"):
        hostenv.debian_mirror("trixie", tmp_path)
    # trixie from the archive that serves the host's bookworm (same URI and keyring).
    trixie = hostenv.suite_mirror("trixie", tmp_path, host_suite="bookworm")
    assert trixie == hostenv.AptSource("http://mirror.example/debian", ("trixie",), ("main",), "/k/one.gpg")
    assert hostenv.suite_mirror("bookworm-updates", tmp_path).uri == "http://other.example/debian"


# --------------------------------------------------------------------------- kernel image

ELF = b"\x7fELF" + bytes(range(256)) * 40


def _bzimage(payload: bytes, *, header: bool = True) -> bytes:
    setup_sects = 1
    image = bytearray((setup_sects + 1) * 512)
    if header:
        image[0x1F1] = setup_sects
        image[0x202:0x206] = b"HdrS"
        struct.pack_into("<II", image, 0x248, 16, len(payload))
    return bytes(image) + b"\0" * 16 + payload + b"trailing setup data"


def test_extract_vmlinux_from_header_and_by_scan() -> None:
    stream = lzma.compress(ELF, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32)
    payload = stream + struct.pack("<I", len(ELF))
    assert kernelimage.extract_vmlinux(_bzimage(payload)) == ELF
    assert kernelimage.extract_vmlinux(_bzimage(payload, header=False)) == ELF


def test_extract_vmlinux_rejects_non_elf_and_missing_stream() -> None:
    stream = lzma.compress(b"not an elf", format=lzma.FORMAT_XZ)
    with pytest.raises(kernelimage.KernelImageError, match="not an ELF"):
        kernelimage.extract_vmlinux(_bzimage(stream + b"\0\0\0\0"))
    with pytest.raises(kernelimage.KernelImageError, match="no xz or zstd"):
        kernelimage.extract_vmlinux(b"\0" * 4096)


# --------------------------------------------------------------------------- initramfs cpio


def _read_newc(data: bytes) -> dict[str, tuple[int, bytes, tuple[int, int]]]:
    entries: dict[str, tuple[int, bytes, tuple[int, int]]] = {}
    pos = 0
    while True:
        assert data[pos : pos + 6] == b"070701"
        fields = [int(data[pos + 6 + 8 * i : pos + 14 + 8 * i], 16) for i in range(13)]
        mode, size, rdev, namesize = fields[1], fields[6], (fields[9], fields[10]), fields[11]
        pos += 110
        name = data[pos : pos + namesize - 1].decode()
        pos = (pos + namesize + 3) & ~3
        body = data[pos : pos + size]
        pos = (pos + size + 3) & ~3
        if name == "TRAILER!!!":
            return entries
        entries[name] = (mode, body, rdev)


def test_cpio_writer_produces_newc_the_kernel_unpacks() -> None:
    cpio = artifacts._Cpio()
    cpio.directory("bin")
    cpio.file("bin/busybox", b"\x7fELF binary", 0o755)
    cpio.symlink("bin/sh", "busybox")
    cpio.chardev("dev/console", 5, 1)
    cpio.file("odd", b"abc")  # forces padding
    entries = _read_newc(cpio.finish())
    assert stat.S_ISDIR(entries["bin"][0])
    assert entries["bin/busybox"][:2] == (stat.S_IFREG | 0o755, b"\x7fELF binary")
    assert stat.S_ISLNK(entries["bin/sh"][0]) and entries["bin/sh"][1] == b"busybox"
    assert stat.S_ISCHR(entries["dev/console"][0]) and entries["dev/console"][2] == (5, 1)
    assert entries["odd"][1] == b"abc"


def test_initramfs_modules_are_plain_elf(tmp_path: Path) -> None:
    """busybox insmod takes plain .ko only; Debian 13's kernel ships .ko.xz."""
    elf = b"\x7fELF module"
    (tmp_path / "a.ko").write_bytes(elf)
    (tmp_path / "b.ko.xz").write_bytes(lzma.compress(elf, format=lzma.FORMAT_XZ))
    (tmp_path / "c.ko.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    assert artifacts._module_bytes(tmp_path / "a.ko") == elf
    assert artifacts._module_bytes(tmp_path / "b.ko.xz") == elf
    with pytest.raises(hostenv.HostError, match="_module_bytes"):
        artifacts._module_bytes(tmp_path / "c.ko.zst")


def test_prune_keeps_other_platforms_and_unprefixed_entries(tmp_path: Path) -> None:
    """A Debian 12 build never deletes a Debian 13 tree (or an older bench's) another run may use."""
    names = ["debian12-old", "debian12-older", "debian12-new", "debian13-a", "debian13-b", "5d1b96167c02c56b"]
    for age, name in enumerate(names):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (1000 - age, 1000 - age))
    artifacts._prune(tmp_path, tmp_path / "debian12-new", artifacts.BOOKWORM.name)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["5d1b96167c02c56b", "debian12-new", "debian12-old", "debian13-a", "debian13-b"]


def test_platforms_are_named_uniquely() -> None:
    assert artifacts.platform_named("debian13") is artifacts.TRIXIE
    assert len({p.name for p in artifacts.PLATFORMS}) == len({p.suite for p in artifacts.PLATFORMS}) == 2
    with pytest.raises(ValueError, match="debian12"):
        artifacts.platform_named("ubuntu2204")


def test_in_tree_keeps_paths_inside(tmp_path: Path) -> None:
    assert artifacts.in_tree(tmp_path, "/etc/hostname") == tmp_path / "etc/hostname"
    for bad in ("/", "/etc/../../host"):
        with pytest.raises(ValueError):
            artifacts.in_tree(tmp_path, bad)


# --------------------------------------------------------------------------- guestcmd


def test_guestcmd_executes_binary_safe_with_timeout() -> None:
    guestcmd = _load_guest("guestcmd")
    blob = bytes(range(256)) * 8
    reply = guestcmd.execute({"id": 1, "argv": ["cat"], "stdin": base64.b64encode(blob).decode()})
    assert reply["kind"] == "reply" and reply["rc"] == 0
    assert base64.b64decode(reply["stdout"]) == blob
    slow = guestcmd.execute({"id": 2, "sh": "echo started; sleep 20", "timeout": 0.5})
    assert slow["timed_out"] and base64.b64decode(slow["stdout"]) == b"started\n"
    missing = guestcmd.execute({"id": 3, "argv": ["/nonexistent/tool"]})
    assert missing["rc"] == 127 and "FileNotFoundError" in missing["error"]


def test_result_check_raises_with_full_output() -> None:
    result = Result(["false"], "tester", 1, b"some out", b"some err")
    with pytest.raises(CommandFailed) as info:
        result.check()
    assert "exited 1" in str(info.value) and "some out" in str(info.value) and "some err" in str(info.value)
    assert Result("true", None, 0, b"", b"").check().ok


# --------------------------------------------------------------------------- vfio_read constants


def test_vfio_ioctl_numbers_match_linux_uapi() -> None:
    vfio = _load_guest("vfio_read")
    assert vfio.VFIO_GET_API_VERSION == 0x3B64
    assert vfio.VFIO_CHECK_EXTENSION == 0x3B65
    assert vfio.VFIO_SET_IOMMU == 0x3B66
    assert vfio.VFIO_GROUP_GET_STATUS == 0x3B67
    assert vfio.VFIO_GROUP_SET_CONTAINER == 0x3B68
    assert vfio.VFIO_GROUP_GET_DEVICE_FD == 0x3B6A
    assert vfio.VFIO_DEVICE_GET_REGION_INFO == 0x3B6C
    assert (vfio.GROUP_STATUS.size, vfio.REGION_INFO.size) == (8, 32)


def test_vfio_read_names_the_failing_step(capsys: pytest.CaptureFixture[str]) -> None:
    vfio = _load_guest("vfio_read")
    assert vfio.main(["vfio_read.py", "0000:ff:1f.7"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "failed: ENOENT" in err


# --------------------------------------------------------------------------- QEMU command line


@pytest.mark.parametrize("accel", ["tcg", "kvm"])
def test_qemu_command_line(tmp_path: Path, accel: str) -> None:
    vm = VM(
        tmp_path / "root.ext4", tmp_path / "vmlinux", tmp_path / "initrd",
        devices=["edu", "virtio-rng-pci"], hotplug_ports=2, accel=accel, name="a,b",
    )  # fmt: skip
    vm.workdir = tmp_path / "work,dir"
    argv = vm.qemu_argv()
    line = " ".join(argv)
    assert ("kernel-irqchip=split" in line) == (accel == "kvm")
    devices = [argv[i + 1] for i, a in enumerate(argv) if a == "-device"]
    assert devices[0] == "intel-iommu,intremap=on"
    assert "pcie-root-port,id=hp0,chassis=1,slot=1" in devices and vm.hotplug_ports == ["hp0", "hp1"]
    assert devices[-2:] == ["edu", "virtio-rng-pci"]
    assert "-netdev" not in argv and "-nic" not in argv and "-nodefaults" in argv
    assert "work,,dir/guestcmd.sock" in line and "tpuboot-a_b" in argv
    assert "intel_iommu=on" in vm.kernel_cmdline()
    assert "intel_iommu" not in VM(tmp_path, tmp_path, tmp_path, iommu=False).kernel_cmdline()
