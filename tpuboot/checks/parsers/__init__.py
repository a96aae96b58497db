"""Readers of the files the checks judge, apart from the checks: each module reads one kind of file
as its real consumer does (the kernel and GRUB, pam_limits, systemd, udev, what runs at boot), and
judges nothing. They live under checks/, not at the top of the tree, because only the checks
read these files."""
