import pytest

from tests.unit.fakes.kernel import FakeKernel
from tpuboot.config import MatchRule
from tpuboot.devices.pci import PciFunction, is_chip_address, is_function_name, parse_dbdf, tpu_functions
from tpuboot.devices.table import DeviceTable, PciIds
from tpuboot.errors import UsageError
from tpuboot.paths import Root


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0000:00:04.0", "0000:00:04.0"),
        ("00:04.0", "0000:00:04.0"),
        ("0001:AF:1F.7", "0001:af:1f.7"),
        (" 0000:05:00.1\n", "0000:05:00.1"),
    ],
)
def test_valid_addresses_are_normalised(text, expected):
    assert parse_dbdf(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "0000:00:04x0",  # the documented script's regex took any character for the dot
        "0000:00:04.8",  # function is 3 bits
        "0000:00:20.0",  # device is 5 bits
        "000:00:04.0",
        "0000:00:04",
        "0000:00:04.0/../../x",
        "",
        "0000:0g:04.0",
    ],
)
def test_malformed_addresses_are_refused_with_the_expected_form(text):
    with pytest.raises(UsageError, match=r"write it as dddd:bb:dd\.f"):
        parse_dbdf(text)


def test_builtin_vfio_generations():
    table = DeviceTable()
    for device, subsystem, name in ((0x62, 0xAD, "TPU v5p"), (0x6F, 0xD1, "TPU v6e"), (0x76, 0xF2, "TPU7x")):
        kind = table.classify(PciIds(0x1AE0, device, 0x1AE0, subsystem))
        assert kind is not None and kind.vfio and kind.name == name


def test_older_generations_are_reported_not_bound():
    kind = DeviceTable().classify(PciIds(0x1AE0, 0x005E, 0x1AE0, 0x0000))
    assert kind is not None and kind.name == "TPU v4" and not kind.vfio


def test_unknown_device_is_not_a_tpu():
    assert DeviceTable().classify(PciIds(0x1AF4, 0x1001)) is None


def test_configured_rule_outranks_report_only_builtin():
    rule = MatchRule(vendor=0x1AE0, device=0x007C, name="TPU8t")
    kind = DeviceTable([rule]).classify(PciIds(0x1AE0, 0x007C, 0x1AE0, 0x0001))
    assert kind is not None and kind.vfio


def test_rule_with_subsystem_requires_it():
    rule = MatchRule(vendor=0x1234, device=0x11E8, subsystem_vendor=0x1AF4, subsystem_device=0x1100)
    table = DeviceTable([rule])
    assert table.classify(PciIds(0x1234, 0x11E8, 0x1AF4, 0x1100)) is not None
    assert table.classify(PciIds(0x1234, 0x11E8, 0x1AF4, 0x1101)) is None


def test_ids_come_from_the_kernels_uevent(tmp_path):
    """The format Linux's pci_uevent() writes, driver line and all."""
    dev = tmp_path / "sys/bus/pci/devices/0000:00:04.0"
    dev.mkdir(parents=True)
    (dev / "uevent").write_text(
        "DRIVER=vfio-pci\nPCI_CLASS=FF0000\nPCI_ID=1AE0:0062\nPCI_SUBSYS_ID=1AE0:00AD\n"
        "PCI_SLOT_NAME=0000:00:04.0\nMODALIAS=pci:v00001AE0d00000062sv00001AE0sd000000ADbcFFsc00i00\n"
    )
    ids = PciFunction(Root(tmp_path), "0000:00:04.0").ids()
    assert (ids.vendor, ids.device, ids.subsystem_vendor, ids.subsystem_device) == (
        0x1AE0,
        0x62,
        0x1AE0,
        0xAD,
    )
    assert DeviceTable().classify(ids).name == "TPU v5p"


@pytest.mark.parametrize("text", ["", "PCI_SLOT_NAME=0000:00:04.0\n", "PCI_ID=zz:1\n", "PCI_ID=1AE0\n"])
def test_a_function_without_readable_ids_reads_as_gone(tmp_path, text):
    dev = tmp_path / "sys/bus/pci/devices/0000:00:04.0"
    dev.mkdir(parents=True)
    (dev / "uevent").write_text(text)
    with pytest.raises(FileNotFoundError, match="no PCI ids"):
        PciFunction(Root(tmp_path), "0000:00:04.0").ids()
    with pytest.raises(FileNotFoundError):
        PciFunction(Root(tmp_path), "0000:00:05.0").ids()  # unplugged


def test_the_tpu_functions_present_are_those_the_table_names(tmp_path):
    """In address order, each with its kind; a NIC and a function whose ids cannot be read are not
    among them (nothing vouches for the latter; the survey reports it)."""
    kernel = FakeKernel(tmp_path)
    kernel.add_device("0000:00:06.0", 0x1AE0, 0x0062, (0x1AE0, 0x00AD))
    kernel.add_device("0000:00:04.0", 0x1AE0, 0x005E)
    kernel.add_device("0000:00:05.0", 0x1AF4, 0x1000)
    kernel.add_device("0000:00:07.0", 0x1AE0, 0x0062, (0x1AE0, 0x00AD))
    kernel.p("/sys/bus/pci/devices/0000:00:07.0/uevent").write_text("")
    found = [(fn.address, kind.name) for fn, kind in tpu_functions(kernel.root, DeviceTable())]
    assert found == [("0000:00:04.0", "TPU v4"), ("0000:00:06.0", "TPU v5p")]
    assert tpu_functions(Root(tmp_path / "empty"), DeviceTable()) == []


@pytest.mark.parametrize(
    ("name", "is_one"),
    [
        ("0000:00:04.0", True),
        ("10000:e1:1f.7", True),  # a VMD domain has 5 digits
        ("0000:00:20.0", False),  # the device number is 5 bits
        ("0000:00:04.8", False),
        ("00:04.0", False),  # sysfs always names the domain
        ("0000:00:04.0 ", False),
        ("pci0000:00", False),
        ("0000:0G:04.0", False),
        ("100000000:00:04.0", False),  # a domain is 32 bits: 8 digits at most
    ],
)
def test_function_names_as_sysfs_gives_them(name, is_one):
    assert is_function_name(name) is is_one


@pytest.mark.parametrize(
    ("text", "is_one"),
    [
        ("0000:00:04", True),
        ("10000:e1:1f", True),  # a VMD domain has 5 digits
        ("0000:00:20", False),  # the device number is 5 bits
        ("0000:00:04.0", False),  # a function, not its chip
        ("00:04", False),
        ("100000000:00:04", False),
    ],
)
def test_chip_addresses_as_base_address_gives_them(text, is_one):
    assert is_chip_address(text) is is_one
