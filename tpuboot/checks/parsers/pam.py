"""pam_limits' files (limits.conf, then limits.d/*.conf): the limit a login gets, read as
pam_limits reads it."""

from __future__ import annotations

from collections.abc import Iterator

from tpuboot.checks.parsers.files import layered, texts
from tpuboot.checks.parsers.rlimits import NOT_SET, UNLIMITED, Limit
from tpuboot.numbers import ascii_int
from tpuboot.paths import Root

PAM_LIMITS = "/etc/security/limits.conf"
PAM_LIMITS_DIR = "/etc/security/limits.d"


def entries(text: str) -> Iterator[list[str]]:
    """Each entry of a limits file as its four fields (domain, type, item, value), comments out."""
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) == 4:
            yield fields


def _value(text: str) -> float:
    if text in ("unlimited", "infinity", "-1"):
        return UNLIMITED
    number = ascii_int(text)  # as pam_limits' strtol would, less its "+" and blanks; 20 digits
    if number is None:
        raise ValueError(text)
    return float(number)


def pam_limit(root: Root, user: str, item: str) -> Limit:
    """The limit pam_limits gives ``user`` (``*``: any user but root) for ``item``.

    As pam_limits: limits.conf, then limits.d/*.conf by name; an entry naming the user beats a
    ``*`` entry, a later entry beats an earlier one of the same kind; ``*`` never applies to
    root. Group entries are ignored (membership is per user)."""
    files = [PAM_LIMITS, *layered(root, (PAM_LIMITS_DIR,), "*.conf")]
    best: dict[str, tuple[int, float, str]] = {}  # soft/hard -> (rank: 0 by name, 1 for *; value; file)
    for shown, text in texts(root, files):
        for domain, kind, entry_item, value in entries(text):
            if entry_item != item:
                continue
            if domain == user and user != "*":
                rank = 0
            elif domain == "*" and user != "root":
                rank = 1
            else:
                continue
            try:
                number = _value(value)
            except ValueError:
                continue  # pam_limits skips a malformed value too
            for which in ("soft", "hard"):
                if kind in (which, "-") and rank <= best.get(which, (2,))[0]:
                    best[which] = (rank, number, shown)
    if not best:
        return NOT_SET
    soft, hard = (best[which][1] if which in best else None for which in ("soft", "hard"))
    return Limit(soft, hard, ", ".join(sorted({entry[2] for entry in best.values()})))
