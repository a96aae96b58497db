"""A fake /proc under a test root: processes with their stat, status, cmdline, cgroup, limits,
PID namespace and open fds (symlinks whose text is what the kernel's would be), /proc/locks, and
the tree's /etc/passwd."""

from __future__ import annotations

import os
from pathlib import Path

HOST_PIDNS = "pid:[4026531836]"
BOOT = 1_764_547_200  # btime: 2025-12-01T00:00:00Z
TICKS = os.sysconf("SC_CLK_TCK")
UNLIMITED = "unlimited"


class FakeProc:
    def __init__(self, top: Path) -> None:
        self.top = top
        self.proc = top / "proc"
        self.proc.mkdir(parents=True, exist_ok=True)
        (self.proc / "stat").write_text(f"cpu  1 2 3 4\nbtime {BOOT}\nprocesses 10\n")
        (self.proc / "locks").write_text("")
        self.users: dict[int, str] = {0: "root"}
        self._passwd()
        (self.proc / "self/ns").mkdir(parents=True)
        os.symlink(HOST_PIDNS, self.proc / "self/ns/pid")

    def _passwd(self) -> None:
        etc = self.top / "etc"
        etc.mkdir(exist_ok=True)
        lines = [f"{name}:x:{uid}:{uid}::/home/{name}:/bin/sh" for uid, name in sorted(self.users.items())]
        (etc / "passwd").write_text("\n".join(lines) + "\n")

    def user(self, uid: int, name: str) -> None:
        self.users[uid] = name
        self._passwd()

    def add(
        self,
        pid: int,
        fds: dict[int, str] | None = None,
        *,
        uid: int = 0,
        state: str = "S",
        cmdline: list[str] | None = None,
        name: str = "python3",
        ppid: int = 1,
        start: int = 1000,
        cgroup: str = "0::/system.slice/train.service\n",
        pidns: str = HOST_PIDNS,
        nspid: list[int] | None = None,
        memlock: str = UNLIMITED,
        capeff: str = "0000000000000000",
    ) -> Path:
        d = self.proc / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "ns").mkdir()
        fields = [state, str(ppid), *["0"] * 17, str(start), "0", "0"]
        (d / "stat").write_text(f"{pid} ({name}) {' '.join(fields)}\n")
        ns = " ".join(str(n) for n in (nspid or [pid]))
        (d / "status").write_text(
            f"Name:\t{name}\nState:\t{state}\nPid:\t{pid}\nPPid:\t{ppid}\n"
            f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}\nNSpid:\t{ns}\nCapEff:\t{capeff}\n"
        )
        argv = ["python3", "train.py"] if cmdline is None else cmdline
        (d / "cmdline").write_bytes(b"".join(w.encode() + b"\0" for w in argv))
        (d / "cgroup").write_text(cgroup)
        (d / "limits").write_text(
            "Limit                     Soft Limit           Hard Limit           Units     \n"
            f"Max open files            1024                 1048576              files     \n"
            f"Max locked memory         {memlock:<21}{memlock:<21}bytes     \n"
        )
        os.symlink(pidns, d / "ns/pid")
        for fd, target in (fds or {}).items():
            os.symlink(target, d / "fd" / str(fd))
        return d

    def remove(self, pid: int) -> None:
        import shutil

        shutil.rmtree(self.proc / str(pid))

    def lock(self, pid: int, path: Path, kind: str = "POSIX") -> None:
        """A lock on ``path`` (a real file of the tree) in /proc/locks, as the kernel lists it."""
        n = len((self.proc / "locks").read_text().splitlines()) + 1
        with open(self.proc / "locks", "a") as f:
            f.write(f"{n}: {kind}  ADVISORY  WRITE {pid} {device(path)} 0 EOF\n")


def device(path: Path) -> str:
    """``major:minor:inode`` of ``path`` as /proc/locks writes it (hex, hex, decimal)."""
    st = path.stat()
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
