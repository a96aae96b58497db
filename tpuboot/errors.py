"""Exceptions whose message is the whole story: what went wrong and how to fix it, in one line."""


def shown(value: object, most: int = 40) -> str:
    """``value`` as a message quotes it: its repr, cut to ``most`` characters (a value from a file
    may be a megabyte). Not :class:`reprlib.Repr`: that elides the middle and bounds each type
    differently; a message keeps the start, where a person looks."""
    text = repr(value)
    return text if len(text) <= most else text[: most - 3] + "..."


def printable(text: str) -> str:
    """``text`` that another user controls (a command line, a file or unit name), as ``ls -b`` and
    ``ps`` print it: every character a terminal would act on (controls, escapes, bidirectional
    overrides, line and paragraph separators) and the backslash itself as an escape, the rest as
    it is. A name cannot then forge a line of output or a journal message, nor hide its end."""
    return "".join(
        char if char.isprintable() and char != "\\" else char.encode("unicode_escape").decode("ascii")
        for char in text
    )


class TpubootError(Exception):
    """Base for every error tpuboot reports to a person; str() is the one-line message."""

    #: Whether retrying later may succeed (the daemon backs off and retries these).
    transient = False


class TimedOut(TpubootError):
    """A command that did not finish in its time (a modprobe on a loaded machine): another try may."""

    transient = True


class LinkLoop(TpubootError):
    """A path whose symbolic links go round (more than the kernel's 40): ``link`` is one of the
    loop, as an absolute path under the root; ``problem`` the message without its fix, for a
    check's or a step's line, whose fix is :func:`loop_fix`."""

    link: str
    problem: str


def loop_fix(exc: LinkLoop) -> str:
    """The fix for a loop of links, naming the link: the start of a message's fix."""
    return f"remove the symbolic link {exc.link}, or point it out of the loop"


class UsageError(TpubootError):
    """The caller asked for something malformed (bad DBDF, bad flag value)."""


class ConfigError(TpubootError):
    """The configuration file is malformed or names an unknown key."""


class DeviceError(TpubootError):
    """A PCI device is missing, not a TPU, or could not be bound."""


class TransientDeviceError(DeviceError):
    """A device step that may succeed on retry (node not yet created, group not yet viable)."""

    transient = True


class IommuOffError(DeviceError):
    """The device has no IOMMU group: the kernel runs without an IOMMU."""


class MetadataError(TpubootError):
    """The metadata server could not give a usable answer."""

    transient = True
