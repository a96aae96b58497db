"""How a variable assignment is spelled where tpuboot reads or writes one: the shell's variable
name (POSIX's, which pam_env, dash, bash and GRUB's default files all accept) and the
/etc/environment line pam_env reads. Kept apart from the readers and writers so that each uses the
one spelling, and a check can read a line without loading tpu-env's YAML parser."""

from __future__ import annotations

import re

#: A shell variable name, as a regular expression (no anchors).
NAME = "[A-Za-z_][A-Za-z0-9_]*"
NAME_RE = re.compile(NAME)
#: A whole string that is a name.
WHOLE_NAME = re.compile(rf"{NAME}\Z")
#: An /etc/environment line (continuations joined) that assigns: optional blanks and ``export``,
#: the key (group 1), ``=``, and the rest as written (group 2).
PAM_ASSIGNMENT = re.compile(rf"[ \t]*(?:export[ \t]+)?({NAME})=(.*)\Z", re.DOTALL)
