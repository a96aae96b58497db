#!/bin/bash
# Baseline for bench/run.py: the documented vfio-pci bind handler, step for step.
# Usage: bind_to_vfio_pci.sh DBDF   (the udev rule passes $kernel)
# Steps: load vfio-pci, set driver_override, unbind the current driver if any, ask the kernel to
# probe, open the group's /dev/vfio node to all users, allow unsafe interrupts on x86_64.

modprobe vfio-pci

if [[ ! $1 =~ ^[[:xdigit:]]{4}:[[:xdigit:]]{2}:[[:xdigit:]]{2}\.[[:xdigit:]]$ ]]; then
    echo "Error: $1 is not a PCI address of the form dddd:bb:dd.f"
    exit 1
fi
dbdf=$1
dev="/sys/bus/pci/devices/$dbdf"

echo vfio-pci > "$dev/driver_override"

if [[ -d $dev/driver ]]; then
    driver=$(readlink "$dev/driver")
    driver=${driver##*/}
    if [[ $driver == vfio-pci ]]; then
        echo "$dbdf is already bound to vfio-pci"
        exit 0
    fi
    echo "$dbdf" > "$dev/driver/unbind"
    if [[ -d $dev/driver ]]; then
        echo "Error: could not unbind $dbdf from $driver"
        exit 1
    fi
    echo "Unbound $dbdf from $driver"
fi
echo "$dbdf" > /sys/bus/pci/drivers_probe
echo "Bound $dbdf to vfio-pci"

group=$(readlink "$dev/iommu_group" | xargs basename)
node="/dev/vfio/$group"
if [[ -c $node ]]; then
    chmod 0666 "$node"
else
    echo "$node not found"
    exit 1
fi

(uname -a | grep -q x86_64) && echo 1 > /sys/module/vfio_iommu_type1/parameters/allow_unsafe_interrupts

echo "Done"
