"""Extract the uncompressed ELF ``vmlinux`` from an x86 bzImage.

QEMU boots an ELF kernel with a PVH note directly (Debian sets CONFIG_PVH=y),
which skips real-mode setup and in-guest decompression: about 3 s per boot
under TCG. The bzImage's setup header says where the compressed payload is;
the kernel build appends the uncompressed size as 4 little-endian bytes.
"""

from __future__ import annotations

import lzma
import shutil
import struct
import subprocess

XZ_MAGIC = b"\xfd7zXZ\x00"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
ELF_MAGIC = b"\x7fELF"


class KernelImageError(ValueError):
    """The bzImage could not be turned into a vmlinux."""


def _payload(bzimage: bytes) -> bytes:
    """The compressed payload (without its size trailer), via the setup header or a scan."""
    if bzimage[0x202:0x206] == b"HdrS" and len(bzimage) > 0x250:
        setup_sects = bzimage[0x1F1] or 4
        offset, length = struct.unpack_from("<II", bzimage, 0x248)
        start = (setup_sects + 1) * 512 + offset
        payload = bzimage[start : start + length]
        if payload.startswith((XZ_MAGIC, ZSTD_MAGIC)) and len(payload) == length:
            return payload[:-4]
    # Older or unusual images: scan for the first known stream.
    for magic in (XZ_MAGIC, ZSTD_MAGIC):
        pos = bzimage.find(magic)
        if pos >= 0:
            return bzimage[pos:]
    raise KernelImageError("no xz or zstd stream in the bzImage")


def _decompress(payload: bytes) -> bytes:
    if payload.startswith(XZ_MAGIC):
        try:
            # Stops at the end of the first stream; trailing bytes land in unused_data.
            return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(payload)
        except lzma.LZMAError as exc:
            raise KernelImageError(f"xz payload: {exc}") from exc
    zstd = shutil.which("zstd")
    if zstd is None:
        raise KernelImageError("zstd payload but no zstd tool on the host")
    proc = subprocess.run([zstd, "-dc"], input=payload, capture_output=True, timeout=120, check=False)
    if not proc.stdout:
        raise KernelImageError(f"zstd payload: {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The ELF kernel inside ``bzimage``; raises KernelImageError if it is not one."""
    elf = _decompress(_payload(bzimage))
    if not elf.startswith(ELF_MAGIC):
        raise KernelImageError("decompressed payload is not an ELF file")
    return elf
